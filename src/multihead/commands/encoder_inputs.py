"""What ``multihead prune`` and ``multihead convert`` read for a sentence encoder (MiniLM, a BERT).

Shakespeare's works sorted by title, the even positions for calibration and
the odd ones held out (as benchmarks/minilm_pruning.py); lines of at least
5 words and at most 64 tokens ([CLS] and [SEP] included)::

    calibration  (line, next line) pairs of the even works, drawn with seed SEED
    held out     lines of the odd works that no even work has, drawn with seed SEED + 1
"""

from __future__ import annotations

import json
import random

__all__ = ["SEED", "MIN_WORDS", "MAX_TOKENS", "HELDOUT_LINES", "check_heldout_lines", "shakespeare_lines"]

SEED = 0
HELDOUT_LINES = 500  # held-out lines of the fidelity, by default
NEIGHBOURS = 10  # the fidelity's neighbour agreement ranks each line's 10 nearest others


def check_heldout_lines(heldout: int | None) -> None:
    """Refuse a held-out count too small to rank each line's ``NEIGHBOURS`` nearest others."""
    if heldout is not None and heldout <= NEIGHBOURS:
        raise ValueError(f"--heldout-lines {heldout}: give a number >= {NEIGHBOURS + 1} "
                         f"(each line's {NEIGHBOURS} nearest neighbours are ranked among the others)")
MIN_WORDS = 5
MAX_TOKENS = 64


_COUNTS: dict[str, dict[str, int]] = {}  # tokenizer.json text -> {line: tokens}, for repeated runs in one process


def _token_counts(tokenizer, lines: list[str]) -> dict[str, int]:
    """Tokens of each line ([CLS] and [SEP] included, truncated at the tokenizer's maximum), unpadded."""
    key = f"{len(lines)} {json.dumps(json.loads(tokenizer.to_str()), sort_keys=True)}"  # its vocabulary in any order
    if key not in _COUNTS:
        counter = tokenizer.__class__.from_str(tokenizer.to_str())  # the same truncation ...
        counter.no_padding()  # ... but no padding to the batch's longest line
        _COUNTS.clear()
        _COUNTS[key] = {s: len(e.ids) for s, e in zip(lines, counter.encode_batch(lines))}
    return _COUNTS[key]


def shakespeare_lines(model, count: int, held_count: int) -> tuple[list[tuple[str, str]], list[str]]:
    """(``count`` calibration pairs, ``held_count`` held-out lines) for ``model`` (its ``tokenizer``
    measures the lines).

    Raises:
        ValueError: more pairs or held-out lines than the works have.
    """
    from ..train.corpus import shakespeare_plays

    texts = shakespeare_plays()
    titles = sorted(texts)
    calib, held = titles[0::2], titles[1::2]

    def lines(title: str) -> list[str | None]:
        return [s.strip() if len(s.split()) >= MIN_WORDS else None for s in texts[title].split("\n")]

    unique = sorted({s for t in titles for s in lines(t) if s})
    lengths = _token_counts(model.tokenizer, unique)

    def short(line: str) -> bool:  # [CLS] and [SEP] included
        return lengths[line] <= MAX_TOKENS

    pairs = [(a, b) for t in calib for a, b in zip(lines(t), lines(t)[1:]) if a is not None and b is not None]
    pairs = [p for p in pairs if short(p[0]) and short(p[1])]
    seen = {s for t in calib for s in lines(t) if s}
    heldout = [s for s in sorted({s for t in held for s in lines(t) if s} - seen) if short(s)]
    if count > len(pairs):
        raise ValueError(f"--calibration-lines {count}: the calibration works have {len(pairs)} line pairs")
    if held_count > len(heldout):
        raise ValueError(f"--heldout-lines {held_count}: the held-out works have {len(heldout)} new lines")
    return random.Random(SEED).sample(pairs, count), random.Random(SEED + 1).sample(heldout, held_count)
