"""Mutation testing of the numerical core (``make mutate``).

    python -m mutation.run [FILE ...] [--max-per-file N] [--workers W] [--out DIR]

For every file of ``mutation.plan.PLAN`` (or the FILEs given), each mutant
(``mutation.mutants``; an even sample of ``--max-per-file`` of them when there
are more) runs the file's tests in a forked child of a worker that imported
torch once. A mutant is *killed* when a test fails or the run takes more than
four times the unmutated run (at least 60 s); it *survives* when every test
passes. The unmutated tests run first and must pass.

Writes DIR/mutation.json and DIR/mutation.md (each to a temporary name, then
renamed) after every file, so Ctrl-C keeps what is finished; prints a line per
file and one per 25 mutants.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

from .mutants import Mutant, mutants
from .plan import PLAN

ROOT = Path(__file__).resolve().parent.parent


class Worker:
    """A ``mutation.worker`` process answering one job at a time."""

    def __init__(self) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mutation.worker", str(ROOT)], cwd=ROOT, env=env,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        if json.loads(self.proc.stdout.readline())["status"] != "ready":
            raise RuntimeError("a mutation worker did not start")

    def run(self, path: str, source: str, tests: list[str], timeout: float) -> dict:
        self.proc.stdin.write(json.dumps({"path": path, "source": source, "tests": tests, "timeout": timeout}) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


def sample(found: list[Mutant], limit: int | None) -> list[Mutant]:
    """``limit`` mutants spread evenly over the file (all of them when there are fewer)."""
    if limit is None or len(found) <= limit:
        return found
    return [found[(i * len(found)) // limit] for i in range(limit)]


def mutate_file(path: str, workers: list[Worker], limit: int | None) -> dict:
    """Run the mutants of ``path`` on ``workers``; the file's result entry."""
    tests = PLAN[path]
    text = (ROOT / path).read_text(encoding="utf-8")
    base = workers[0].run(path, text, tests, timeout=3600)
    if base["status"] != "passed":
        raise SystemExit(f"the unmutated tests of {path} do not pass ({base}): fix them first")
    timeout = max(60.0, 4 * base["seconds"])
    found = mutants(path, text)
    chosen = sample(found, limit)
    jobs: queue.Queue = queue.Queue()
    for m in chosen:
        jobs.put(m)
    results: list[tuple[Mutant, dict]] = []
    lock = threading.Lock()

    def drain(worker: Worker) -> None:
        while True:
            try:
                m = jobs.get_nowait()
            except queue.Empty:
                return
            outcome = worker.run(path, m.source, tests, timeout)
            with lock:
                results.append((m, outcome))
                if len(results) % 25 == 0:
                    print(f"  {path}: {len(results)}/{len(chosen)} mutants run", flush=True)

    threads = [threading.Thread(target=drain, args=(w,)) for w in workers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    results.sort(key=lambda r: chosen.index(r[0]))
    survived = [{"line": m.line, "mutant": m.description} for m, r in results if r["status"] == "passed"]
    return {
        "tests": tests, "mutants": len(found), "run": len(results), "baseline_s": round(base["seconds"], 1),
        "killed": sum(r["status"] == "failed" for _, r in results),
        "timeouts": sum(r["status"] == "timeout" for _, r in results),
        "survived": survived,
    }  # fmt: skip


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def markdown(report: dict) -> str:
    lines = [
        f"Mutation run of {report['date']} ({report['seconds']:.0f} s, {report['workers']} workers, "
        f"at most {report['max_per_file']} mutants per file).", "",
        "| file | mutants | run | killed | timeouts | survived |", "|---|---|---|---|---|---|",
    ]  # fmt: skip
    for path, r in report["files"].items():
        lines.append(f"| {path} | {r['mutants']} | {r['run']} | {r['killed']} | {r['timeouts']} | {len(r['survived'])} |")
    for path, r in report["files"].items():
        if r["survived"]:
            lines += ["", f"Survivors in {path}:"] + [f"- {s['mutant']}" for s in r["survived"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mutation.run", description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="*", help="files of the plan to mutate (default: all)")
    parser.add_argument("--max-per-file", type=int, default=60, help="mutants per file, spread evenly (default 60)")
    parser.add_argument("--workers", type=int, default=2, help="parallel workers (default 2)")
    parser.add_argument("--out", default="mutation-report", help="folder for mutation.json/.md (default mutation-report)")
    args = parser.parse_args(argv)
    unknown = [f for f in args.files if f not in PLAN]
    if unknown:
        parser.error(f"not in mutation/plan.py: {unknown}; known: {sorted(PLAN)}")
    if args.max_per_file < 1 or args.workers < 1:
        parser.error(f"--max-per-file and --workers must be >= 1, got {args.max_per_file} and {args.workers}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"date": time.strftime("%Y-%m-%d"), "workers": args.workers, "max_per_file": args.max_per_file,
              "seconds": 0.0, "files": {}}  # fmt: skip
    start = time.perf_counter()
    workers = [Worker() for _ in range(args.workers)]
    try:
        for path in args.files or list(PLAN):
            t0 = time.perf_counter()
            result = mutate_file(path, workers, args.max_per_file)
            report["files"][path] = result
            report["seconds"] = time.perf_counter() - start
            write_atomic(out / "mutation.json", json.dumps(report, indent=2) + "\n")
            write_atomic(out / "mutation.md", markdown(report))
            print(f"{path}: {result['run']} of {result['mutants']} mutants run, {result['killed']} killed, "
                  f"{result['timeouts']} timed out, {len(result['survived'])} survived "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)  # fmt: skip
    except KeyboardInterrupt:
        print(f"interrupted: {len(report['files'])} files finished, kept in {out}", file=sys.stderr)
        return 130
    finally:
        for w in workers:
            w.close()
    print(f"report: {out / 'mutation.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
