"""``python -m multihead``: the ``multihead`` command."""

import sys

from .cli import main

sys.exit(main())
