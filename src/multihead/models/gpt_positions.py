"""Where a GPT's tokens get their positions, and streaming caches for decoding past its context.

``GPTConfig(positions=...)``:

    "learned"  GPT-2's table: x = token_embedding(idx) + position_embedding(pos),
               [context_length, C] parameters; what Hugging Face GPT-2 holds
    "rope"     no table; every block's attention takes ``rope=True`` unless its
               options set ``rope`` (a dict of rope options, or False for a
               layer without it)
    "alibi"    no table; every block's attention takes ``alibi=True`` unless its
               options set ``alibi``
    "none"     no table and nothing added: order comes from the causal mask
               alone, unless options set rope or alibi themselves

Rope and ALiBi see only distances between tokens, so without a table a model
can decode past ``context_length`` with a streaming cache per block
(``streaming_caches``; StreamingLLM, Xiao et al. 2023, arXiv:2309.17453): the
first ``sink_tokens`` tokens and the last ``window`` stay, placed at their
slots in the cache (``modules.streaming_cache``, ``positions="cache"``), so no
distance exceeds ``sink_tokens + window - 1`` however long the text grows. A
learned table has a row for each of the first ``context_length`` positions and
no way to place a token past them, so a model with one is refused.
"""

from __future__ import annotations

from typing import Any

from .._checks import non_negative_int, positive_int

__all__ = [
    "POSITIONS", "check_positions", "position_options", "check_streaming", "check_streaming_call", "streaming_caches",
]  # fmt: skip

POSITIONS = ("learned", "rope", "alibi", "none")
_OPTION = {"rope": "rope", "alibi": "alibi"}  # the attention option each one turns on


def check_positions(value: object) -> str:
    """The ``positions`` field: one of ``POSITIONS``.

    Raises:
        ValueError: another value, naming it and the choices.
    """
    if value not in POSITIONS:
        raise ValueError(f"positions must be one of {list(POSITIONS)}, got positions={value!r}")
    return value


def position_options(positions: str, given: dict[str, Any]) -> dict[str, Any]:
    """The attention options ``positions`` adds under a block's own ``given``
    options (which win): ``{"rope": True}``, ``{"alibi": True}`` or none."""
    name = _OPTION.get(positions)
    return {} if name is None or name in given else {name: True}


def check_streaming(config: Any, sink_tokens: object, window: object) -> tuple[int, int]:
    """(sink_tokens, window) for streaming decoding of a model of ``config``.

    Raises:
        TypeError / ValueError: not ints (sinks >= 0, window >= 1), more than
            ``context_length`` positions in all, or a model with a learned
            position table (which cannot place a token past it).
    """
    if config.positions == "learned":
        raise ValueError(
            f"streaming needs relative positions (rope, alibi or none); this model has a learned position table "
            f"of context_length={config.context_length} rows, which cannot place a token past it"
        )
    sink_tokens = non_negative_int("sink_tokens", sink_tokens)
    window = positive_int("window", window)
    if sink_tokens + window > config.context_length:
        raise ValueError(
            f"streaming keeps sink_tokens + window = {sink_tokens} + {window} = {sink_tokens + window} positions, "
            f"more than the model's context_length={config.context_length}"
        )
    return sink_tokens, window


def check_streaming_call(config: Any, attention_mask: object, position_ids: object) -> None:
    """What a forward over streaming caches refuses: a learned position table
    (a cache built for another model), and ``attention_mask`` / ``position_ids``
    (the caches place every token themselves and keep no padding).

    Raises:
        ValueError: naming what was given.
    """
    check_streaming(config, 0, 1)
    given = [name for name, value in (("attention_mask", attention_mask), ("position_ids", position_ids))
             if value is not None]  # fmt: skip
    if given:
        raise ValueError(f"a forward over streaming caches takes no {' or '.join(given)}: the caches place every "
                         "token at its slot, and a padded batch cannot stream")  # fmt: skip


def streaming_caches(model: Any, batch_size: int, *, sink_tokens: int, window: int, max_step: int) -> list[Any]:
    """One ``StreamingKVCache`` per block of the GPT ``model``, with
    ``positions="cache"`` (module docstring).

    Raises:
        ValueError / TypeError: as ``check_streaming``; an attention kind
            whose cache holds more than keys and values.
    """
    from ..modules.streaming_cache import streaming_cache

    sink_tokens, window = check_streaming(model.config, sink_tokens, window)
    positive_int("batch_size", batch_size)
    return [
        streaming_cache(block.attn, batch_size, sink_tokens=sink_tokens, window=window, max_step=max_step,
                        positions="cache")  # fmt: skip
        for block in model.blocks
    ]
