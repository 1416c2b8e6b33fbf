"""``python -m multihead``: the ``multihead`` command."""

import os
import sys

from .cli import main

code = main()
if int(os.environ.get("WORLD_SIZE", "1") or 1) > 1:
    # Under torchrun, leave without the interpreter's teardown once the command is done (its
    # files are written and its process group destroyed): gloo's worker threads can abort a
    # finished process while static objects are destroyed ("terminate called without an
    # active exception"), which torchrun would report as a failed run.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)
sys.exit(code)
