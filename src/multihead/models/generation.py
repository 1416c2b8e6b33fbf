"""Autoregressive decoding: logit filters, one sampling step, the generate loop.

    prompt idx [B, T0] --prefill (one forward, fills the KV caches)--> logits
      --(temperature, top-k, top-p, sample or argmax)--> token t0
      --forward(t0 [B, 1], caches)--> logits --> t1 --> ... (max_new_tokens)

The loop works with any model that has ``config.context_length``,
``config.vocab_size``, ``forward(idx, *, attention_mask=None, kv_caches=None,
logits_to_keep=0) -> logits [B, T, V]`` (the last ``logits_to_keep`` positions
when it is not 0: the loop asks for 1, so a prefill computes the LM head for
its last position only) and ``make_kv_caches(batch_size, max_len)`` (``GPT``).
Call ``model.eval()`` first: the loop does not change the model's mode.

Past the model's ``context_length`` the window slides: each step the model
sees the last ``context_length`` tokens (nanoGPT's crop). A learned position
embedding makes a cached window unusable once it moves, so from then on every
step recomputes its window (with the cache: reset and prefilled again), and
the cached and uncached paths stay the same computation.

``streaming=(k, w)`` instead keeps one ``StreamingKVCache`` per block (a
model without a learned position table: ``GPT.make_streaming_caches``): the
first k tokens and the last w stay, placed at their cache slots (StreamingLLM,
``models.gpt_positions``), so generation runs past ``context_length`` in
memory of k + w positions (plus the prompt's prefill, once). The prompt's
first min(T0, k + w) tokens are one forward, the rest of it one token at a
time, so every step sees what token-by-token decoding would::

    step  t  sees  tokens 0 .. k-1 (sinks) + t-w+1 .. t   at positions 0 .. k+w-1

A step reads nothing back to the host except, with ``eos``, whether every
row is done (Hugging Face's loop checks that too): the prompt's ids are
range-checked once, and the steps run inside ``gpt_inputs.known_token_ids``
(an argmax or a draw over the vocabulary is in range). What the model's
layers read themselves (eager attention's non-finite check on CPU) is theirs.

``compile_steps=True`` on CUDA records the one-token step as a CUDA graph.
A graph replays fixed shapes and addresses, and a ``KVCache`` step returns
[B, G, length, D], one position longer every step, so after the eager
prefill the steps run over ``modules.graph_cache.GraphKVCache``s: buffers
kept per model, ``context_length`` slots long (``_STEP_BUFFERS``, the same
addresses in every call of the same batch size; ``models.decode_steps``),
the prefill's keys and values copied in, every step
writing at a device-side position and attending over all slots, masked::

    prefill (eager)  -> KVCache buffers --copy--> step buffers, position = T0
    step  (graph)    -> write k, v at position; attend slots <= position;
                        position += 1 (on the device)

Left-padded prompts (``attention_mask`` [B, T0], 1 = real token, pads on the
left) keep their pads in the cache; the mask over the cached length is passed
on every step so pads are never attended::

    mask   0 0 1 1 1 | 1 1 ...    <- prompt (two pads) | generated tokens
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch

from .._checks import non_negative_int, positive_int
from .decode_steps import compiled_steps
from .gpt_inputs import check_token_ids, known_token_ids

__all__ = ["filter_top_k", "filter_top_p", "sample_next_token", "generate"]


def filter_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the ``k`` largest logits of each row (and ties with the k-th), -inf elsewhere.

    Args:
        logits: [..., V].
        k: positive int; k >= V keeps everything.

    Returns:
        a new tensor shaped like ``logits``.
    """
    k = positive_int("top_k", k)
    if k >= logits.shape[-1]:
        return logits.clone()
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]  # (..., 1)
    return logits.masked_fill(logits < kth, float("-inf"))


def filter_top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Nucleus filter: keep, per row, the smallest set of most likely tokens
    whose probability mass is >= ``p``; -inf elsewhere.

    Tokens are taken in order of decreasing probability; a token is kept when
    the mass of the tokens before it is still below ``p``, so the most likely
    token is always kept::

        probs   0.5  0.3  0.15  0.05      p = 0.8
        before  0.0  0.5  0.8   0.95      keep 0.5, 0.3 (mass 0.8 >= p)

    Args:
        logits: [..., V].
        p: in (0, 1]; 1 keeps everything.

    Returns:
        a new tensor shaped like ``logits``.
    """
    p = _probability("top_p", p)
    if p >= 1.0:
        return logits.clone()
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    probs = torch.softmax(sorted_logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
    before = torch.cumsum(probs, dim=-1) - probs  # mass of the more likely tokens
    drop_sorted = before >= p
    drop_sorted[..., 0] = False
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def sample_next_token(
    logits: torch.Tensor,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Pick one token per row from next-token logits.

    temperature == 0 takes the argmax (greedy; top_k/top_p do not change it);
    otherwise logits / temperature, then top-k, then top-p, then a draw from
    the softmax with ``generator``.

    Args:
        logits: [B, V].

    Returns:
        token ids [B] (long).
    """
    temperature = _temperature(temperature)
    if temperature == 0.0:
        return logits.argmax(dim=-1)
    scores = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
    if top_k is not None:
        scores = filter_top_k(scores, top_k)
    if top_p is not None:
        scores = filter_top_p(scores, top_p)
    probs = torch.softmax(scores, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)  # (B, 1) -> (B,)


def generate(
    model: Any,
    idx: torch.Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos: int | None = None,
    pad: int | None = None,
    attention_mask: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    use_cache: bool = True,
    return_logits: bool = False,
    compile_steps: bool = False,
    streaming: tuple[int, int] | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Extend ``idx`` by up to ``max_new_tokens`` tokens.

    Args:
        model: a ``GPT`` (or anything with the same interface, see the module).
        idx: [B, T0] prompt ids, left-padded when rows differ in length.
        max_new_tokens: number of tokens to add (0 returns ``idx``); past the
            context length the model sees the last ``context_length`` tokens.
        temperature: 0 = greedy argmax; > 0 divides the logits before sampling.
        top_k: keep the k most likely tokens before sampling.
        top_p: keep the smallest set of tokens with mass >= top_p.
        eos: a row that emits ``eos`` is done: afterwards it emits ``pad``,
            and the loop stops early once every row is done.
        pad: emitted by finished rows (default ``eos``).
        attention_mask: [B, T0], 1 = real token, 0 = left padding.
        generator: ``torch.Generator`` for the draws (reproducible sampling).
        use_cache: True: one static KV cache per block, prefill once, then
            one token per forward. False: recompute the whole sequence every
            step (the reference the cached path is tested against).
        return_logits: also return the raw next-token logits of every step
            (before temperature and filtering).
        compile_steps: run the one-token steps over the static cache through
            ``torch.compile(fullgraph=True)`` (the prefill, a padded batch's
            steps and the steps once the window slides stay eager). On CPU
            (and on CUDA for a model that does not qualify, below) the steps
            grow the ``KVCache`` in inductor's default mode: the cache length
            is a Python int that becomes symbolic, so the steps of a call
            compile twice in all (``modules.kv_cache``). On CUDA, for a
            model whose blocks all pass ``modules.graph_cache.
            supports_graph_steps`` (no rope, ALiBi or window; GPT-2's
            layout does), the steps run over ``GraphKVCache``s of one fixed
            shape with mode="reduce-overhead": one compile (static shapes),
            then one CUDA graph replayed every step, with no host read in
            a step (module docstring). The first call compiles (seconds
            on CPU, tens of seconds for GPT-2 small on CUDA).
        streaming: None, or (sink_tokens, window): decode with streaming
            caches (module docstring) for any number of tokens; sink_tokens +
            window <= context_length. Not with padding, ``use_cache=False``
            or ``compile_steps``.

    Returns:
        tokens [B, T0 + n] with n <= max_new_tokens (n < max_new_tokens only
        when every row hit ``eos``), or (tokens, logits [B, n, V]).

    Raises:
        TypeError / ValueError: bad arguments, including a prompt longer
            than the context length, a mask that is not
            left padding, or a row with no real token, streaming for a
            model with a learned position table (all checked before any
            forward pass).
    """
    cfg = model.config
    if not isinstance(idx, torch.Tensor):
        raise TypeError(f"idx must be a torch.Tensor, got {type(idx).__name__}")
    if idx.dtype.is_floating_point or idx.dtype.is_complex or idx.dtype == torch.bool:
        raise TypeError(f"idx must hold integer token ids, got dtype {idx.dtype}")
    if idx.dim() != 2 or idx.shape[0] == 0 or idx.shape[1] == 0:
        raise ValueError(f"idx must be (B, T0) with B, T0 >= 1, got {tuple(idx.shape)}")
    B, T0 = idx.shape
    check_token_ids(idx.long(), cfg.vocab_size)  # the prompt, once: the steps feed ids the model produced
    max_new_tokens = non_negative_int("max_new_tokens", max_new_tokens)
    window = cfg.context_length
    if T0 > window:
        raise ValueError(f"prompt length {T0} exceeds context_length={window}; pass its last {window} tokens")
    _temperature(temperature)
    if not isinstance(compile_steps, bool):
        raise TypeError(f"compile_steps must be a bool, got {compile_steps!r}")
    if top_k is not None:
        positive_int("top_k", top_k)
    if top_p is not None:
        _probability("top_p", top_p)
    eos = _token("eos", eos, cfg.vocab_size)
    pad = eos if pad is None else _token("pad", pad, cfg.vocab_size)
    mask = None
    if attention_mask is not None:
        if not isinstance(attention_mask, torch.Tensor):
            raise TypeError(f"attention_mask must be a torch.Tensor, got {type(attention_mask).__name__}")
        if tuple(attention_mask.shape) != (B, T0):
            raise ValueError(f"attention_mask must be (B, T0) = ({B}, {T0}), got {tuple(attention_mask.shape)}")
        mask = attention_mask.to(idx.device) != 0
        if not bool(mask[:, -1].all()):
            raise ValueError(
                "attention_mask must be left padding (the last prompt position real in every row); "
                f"rows {mask[:, -1].logical_not().nonzero().flatten().tolist()} end in padding"
            )
        if bool(mask.all()):
            mask = None  # no padding: take the mask-free path
    if streaming is not None:  # the caches are built here: the model refuses a learned table before any forward
        sink_tokens, stream_window = _streaming(streaming, mask is not None, use_cache, compile_steps)
        first = min(T0, sink_tokens + stream_window)  # the prompt's first forward; the rest one token at a time
        stream_caches = model.make_streaming_caches(B, sink_tokens=sink_tokens, window=stream_window, max_step=first)
    idx = idx.long()
    if max_new_tokens == 0:
        empty = torch.zeros(B, 0, cfg.vocab_size, device=idx.device)
        return (idx, empty) if return_logits else idx

    if streaming is not None:
        caches = stream_caches
    else:
        caches = model.make_kv_caches(B, min(window, T0 + max_new_tokens)) if use_cache else None
    compiled = None
    if compile_steps and use_cache and mask is None:
        compiled = compiled_steps(model, caches, idx.device)
    tokens, done, steps = idx, torch.zeros(B, dtype=torch.bool, device=idx.device), []
    with torch.no_grad(), known_token_ids():  # checked above; later ids come from the model's vocabulary
        for step in range(max_new_tokens):
            if streaming is not None:
                logits = _stream_step(model, tokens, caches, first if step == 0 else None, T0)
            else:
                logits = _step(model, tokens, mask, caches, compiled, step, window)
            steps.append(logits)
            nxt = sample_next_token(logits, temperature=temperature, top_k=top_k, top_p=top_p, generator=generator)
            if eos is not None:
                nxt = torch.where(done, torch.full_like(nxt, pad), nxt)
                done = done | (nxt == eos)
            tokens = torch.cat([tokens, nxt[:, None]], dim=1)  # (B, T) -> (B, T + 1)
            if mask is not None:
                mask = torch.cat([mask, mask.new_ones(B, 1)], dim=1)
            if eos is not None and bool(done.all()):
                break
    if return_logits:
        return tokens, torch.stack(steps, dim=1)  # n x (B, V) -> (B, n, V)
    return tokens


def _step(model, tokens, mask, caches, compiled, step: int, window: int) -> torch.Tensor:
    """Next-token logits [B, V] of one step over the static caches (or none)."""
    seen = mask
    if tokens.shape[1] > window:  # the window slides: recompute the last `window` tokens
        feed, seen = tokens[:, -window:], None if mask is None else mask[:, -window:]
        for cache in caches or ():
            cache.reset()
    else:
        feed = tokens if (caches is None or step == 0) else tokens[:, -1:]
        if compiled is not None and step > 0:  # a one-token step over the cache
            return compiled(feed, caches)
    return model(feed, attention_mask=seen, kv_caches=caches, logits_to_keep=1)[:, -1]


def _stream_step(model, tokens, caches, first: int | None, T0: int) -> torch.Tensor:
    """Next-token logits [B, V] over streaming caches: the prompt (``first``
    tokens in one forward, the rest one at a time) or the last token."""
    if first is None:
        return model(tokens[:, -1:], kv_caches=caches, logits_to_keep=1)[:, -1]
    logits = model(tokens[:, :first], kv_caches=caches, logits_to_keep=1)[:, -1]
    for t in range(first, T0):
        logits = model(tokens[:, t : t + 1], kv_caches=caches, logits_to_keep=1)[:, -1]
    return logits


# ---------------------------------------------------------------------- checks
def _streaming(value: object, padded: bool, use_cache: object, compile_steps: bool) -> tuple[int, int]:
    """(sink_tokens, window) of ``streaming``; the model checks their range."""
    if isinstance(value, (str, bytes)) or not isinstance(value, (tuple, list)) or len(value) != 2:
        raise TypeError(f"streaming must be None or a pair (sink_tokens, window), got streaming={value!r}")
    sink_tokens = non_negative_int("sink_tokens", value[0])
    window = positive_int("window", value[1])
    refused = [name for name, on in (("a padded attention_mask", padded), ("use_cache=False", use_cache is False),
                                     ("compile_steps=True", compile_steps)) if on]  # fmt: skip
    if refused:
        raise ValueError(f"streaming={tuple(value)} cannot go with {', '.join(refused)}: it decodes token by token "
                         "over streaming caches, one row position per token")  # fmt: skip
    return sink_tokens, window


def _temperature(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not (0 <= float(value) < math.inf):
        raise ValueError(f"temperature must be a finite float >= 0 (0 = greedy), got temperature={value!r}")
    return float(value)


def _probability(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not (0 < float(value) <= 1):
        raise ValueError(f"{name} must be a float in (0, 1], got {name}={value!r}")
    return float(value)


def _token(name: str, value: object, vocab_size: int) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not 0 <= int(value) < vocab_size:
        raise ValueError(f"{name} must be a token id in [0, {vocab_size}), got {name}={value!r}")
    return int(value)
