"""A text file where only an induction head predicts: random strings, each followed by its repeat.

    python -m benchmarks.induction_data OUT.txt [--lines 40000] [--min-len 6] [--max-len 24]
                                        [--alphabet 52] [--successors K] [--seed 0]

Each line is ``s|s`` and a newline, ``s`` a string of ``--min-len`` to
``--max-len`` characters (uniform length) drawn uniformly, with repetition,
from the first ``--alphabet`` characters of ``a-zA-Z0-9``; with
``--successors K``, each character after the first two is instead one of K
characters that a fixed random table (seeded) assigns to the two before it,
so the previous token helps to predict the first copy too (a use for a
previous-token head before any induction). The first copy of ``s`` is
(mostly) unpredictable; in the second, each character is the one that
followed the previous character's earlier occurrence, at a distance that
changes with the length of ``s``: only looking up that occurrence (an
induction head) predicts it, not a fixed relative position. With a byte
tokenizer and a training window of many lines, the repeats sit at every
offset of the window. Seeded: the same arguments write the same file
(about ``lines * (max_len + min_len + 2)`` bytes).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import numpy as np

CHARACTERS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"


def induction_lines(lines: int, min_len: int, max_len: int, alphabet: int, seed: int, successors: int = 0) -> str:
    """The file's text: ``lines`` lines ``s|s`` (``s`` of min_len..max_len characters; ``successors``
    > 0: each character after the first two drawn from that many, fixed by the two before it)."""
    if not 1 <= min_len <= max_len:
        raise ValueError(f"need 1 <= min_len <= max_len, got min_len={min_len}, max_len={max_len}")
    if not 2 <= alphabet <= len(CHARACTERS):
        raise ValueError(f"alphabet={alphabet} must be in 2..{len(CHARACTERS)}")
    if lines < 1:
        raise ValueError(f"lines={lines} must be at least 1")
    if not 0 <= successors <= alphabet:
        raise ValueError(f"successors={successors} must be in 0..alphabet={alphabet}")
    rng = np.random.default_rng(seed)
    chars = np.array(list(CHARACTERS[:alphabet]))
    # table[a, b]: the characters that may follow a, b ([alphabet, alphabet, successors])
    table = np.stack([rng.permutation(alphabet)[:successors] for _ in range(alphabet * alphabet)])
    table = table.reshape(alphabet, alphabet, successors)
    out = []
    for length in rng.integers(min_len, max_len + 1, size=lines):
        ids = rng.integers(0, alphabet, size=length)
        if successors:
            picks = rng.integers(0, successors, size=length)
            for i in range(2, length):
                ids[i] = table[ids[i - 2], ids[i - 1], picks[i]]
        s = "".join(chars[ids])
        out.append(f"{s}|{s}\n")
    return "".join(out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--lines", type=int, default=40000)
    parser.add_argument("--min-len", type=int, default=6)
    parser.add_argument("--max-len", type=int, default=24)
    parser.add_argument("--alphabet", type=int, default=52)
    parser.add_argument("--successors", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        text = induction_lines(args.lines, args.min_len, args.max_len, args.alphabet, args.seed, args.successors)
    except ValueError as exc:
        parser.error(str(exc))
    tmp = args.out.with_name(args.out.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, args.out)
    print(f"wrote {args.out}: {args.lines} lines, {len(text)} bytes")


if __name__ == "__main__":
    main()
