"""One mutation worker: ``python -m mutation.worker ROOT`` (started by ``mutation.run``).

It copies ``ROOT/src`` to a temporary directory, imports torch and pytest once,
then reads one JSON job per line on stdin::

    {"path": "src/multihead/...", "source": "<the file, mutated or not>",
     "tests": ["tests/..."], "timeout": 60}

writes the source into its copy, forks a child that runs ``pytest -x`` on the
tests against the copy, puts the original file back, and answers one JSON line
``{"status": "passed" | "failed" | "timeout", "seconds": s}``. Forking after the
imports saves their cost on every mutant.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path


def _child(root: Path, src: Path, tests: list[str]) -> None:
    """Run the tests against ``src`` and exit with pytest's status (never returns)."""
    try:
        sys.path.insert(0, str(src))
        os.environ["PYTHONPATH"] = os.pathsep.join([str(src), *filter(None, [os.environ.get("PYTHONPATH")])])
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        import pytest

        code = pytest.main([*tests, "-x", "-q", "-p", "no:cacheprovider", "--rootdir", str(root)])
        os._exit(int(code))
    except BaseException:  # noqa: BLE001 - anything here is a failed run
        os._exit(99)


def _run(root: Path, src: Path, job: dict) -> dict:
    target = src / Path(job["path"]).relative_to("src")
    original = target.read_text(encoding="utf-8")
    target.write_text(job["source"], encoding="utf-8")
    start = time.perf_counter()
    try:
        pid = os.fork()
        if pid == 0:
            os.setpgid(0, 0)  # its own group: a timeout also stops the processes tests start
            os.chdir(root)
            _child(root, src, [str(root / t) for t in job["tests"]])
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                code = os.waitstatus_to_exitcode(status)
                return {"status": "passed" if code == 0 else "failed", "code": code,
                        "seconds": time.perf_counter() - start}  # fmt: skip
            if time.perf_counter() - start > job["timeout"]:
                os.killpg(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                return {"status": "timeout", "seconds": time.perf_counter() - start}
            time.sleep(0.02)
    finally:
        target.write_text(original, encoding="utf-8")


def main() -> None:
    root = Path(sys.argv[1]).resolve()
    sys.dont_write_bytecode = True
    os.environ["PYTHONDONTWRITEBYTECODE"] = "1"
    with tempfile.TemporaryDirectory(prefix="multihead-mutation-") as tmp:
        src = Path(tmp) / "src"
        shutil.copytree(root / "src", src, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        import numpy  # noqa: F401 - imported once, before the forks
        import pytest  # noqa: F401
        import torch  # noqa: F401

        print(json.dumps({"status": "ready"}), flush=True)
        for line in sys.stdin:
            print(json.dumps(_run(root, src, json.loads(line))), flush=True)


if __name__ == "__main__":
    main()
