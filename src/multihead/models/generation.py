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

Left-padded prompts (``attention_mask`` [B, T0], 1 = real token, pads on the
left) keep their pads in the cache; the mask over the cached length is passed
on every step so pads are never attended::

    mask   0 0 1 1 1 | 1 1 ...    <- prompt (two pads) | generated tokens
"""

from __future__ import annotations

import math
import numbers
import weakref
from typing import Any, NamedTuple

import torch

from .._checks import non_negative_int, positive_int
from ..modules.graph_cache import GraphKVCache, supports_graph_steps
from ..modules.kv_cache import KVCache
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
            ``torch.compile(fullgraph=True)`` (the prefill and a padded batch's
            steps stay eager). The first call compiles (seconds); the cache
            length is a Python int that becomes symbolic, so the steps of a
            call compile twice in all (``modules.kv_cache``).
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
        compiled = _compiled_steps(model, caches, idx.device)
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


def _uses_cuda_graphs(model, caches, device: torch.device) -> bool:
    """Whether ``compile_steps`` records the steps as a CUDA graph: on CUDA, for a
    model whose every block decodes over a ``GraphKVCache`` (``modules.graph_cache``)."""
    blocks = getattr(model, "blocks", None)
    return (device.type == "cuda" and blocks is not None and all(type(c) is KVCache for c in caches)
            and all(supports_graph_steps(b.attn) for b in blocks))  # fmt: skip


def _compiled_steps(model, caches, device: torch.device):
    """``step(feed [B, 1], caches) -> logits [B, V]`` for the one-token steps after the prefill.

    On CUDA, when the model qualifies: ``_GraphSteps`` (torch.compile
    mode="reduce-overhead", a CUDA graph replayed every step). Otherwise the
    steps over the growing ``KVCache`` through torch.compile(fullgraph=True)
    in its default mode (the cache length symbolic: two compiles, ``modules.kv_cache``).
    """
    if _uses_cuda_graphs(model, caches, device):
        return _GraphSteps(model, {"mode": "reduce-overhead", "dynamic": False})
    step = torch.compile(lambda feed, kv: model(feed, kv_caches=kv, logits_to_keep=1), fullgraph=True)
    return lambda feed, kv: step(feed, kv)[:, -1]  # (B, 1, V) -> (B, V)


def _graph_step(model, feed: torch.Tensor, caches: list[GraphKVCache], position: torch.Tensor) -> torch.Tensor:
    """One token over the GraphKVCaches; moves ``position`` on by one. logits [B, V]."""
    logits = model(feed, kv_caches=caches, logits_to_keep=1)[:, -1]  # (B, 1, V) -> (B, V)
    position.add_(1)
    return logits


class _GraphSteps:
    """The one-token steps of ``generate`` calls over ``GraphKVCache``s.

    The first step of a call copies the prefilled caches' keys and values
    into the model's step buffers (``_STEP_BUFFERS``: kept per model, reused
    by every call with the same cache shapes, so their addresses never
    change) at a device-side position = the prompt's length. The buffers
    and the position are static addresses
    (``torch._dynamo.mark_static_address``: the in-place writes of a step
    stay inside the recorded graph and nothing is copied in), and
    ``_graph_step`` is compiled with ``options`` (torch.compile's keywords;
    fullgraph=True): every step has the same shapes and no Python int that
    changes, so one compile serves every step and every later call, and
    "reduce-overhead" records it once as a CUDA graph (cudagraph trees: a
    warm-up run, a recording, then replays, in this and later calls). The
    logits are cloned: the graph's output buffer is overwritten by the next
    replay. The caller's ``KVCache``s are left as the prefill wrote them.
    """

    def __init__(self, model, options: dict) -> None:
        self.model, self.options = model, options
        self.state = None

    def __call__(self, feed: torch.Tensor, caches: list) -> torch.Tensor:
        if self.state is None:
            self.state = _step_buffers(self.model, caches, self.options)
            n = caches[0].length
            for g, c in zip(self.state.caches, caches):
                g.k[:, :, :n].copy_(c.k[:, :, :n])
                g.v[:, :, :n].copy_(c.v[:, :, :n])
            self.state.position.fill_(n)
        state = self.state
        feed = feed.clone(memory_format=torch.contiguous_format)  # strides (1, 1) every step: a view of tokens recompiles
        torch.compiler.cudagraph_mark_step_begin()
        return state.step(self.model, feed, state.caches, state.position).clone()


class _StepBuffers(NamedTuple):
    key: tuple  # the caches' shapes, dtypes and device, and the compile options
    caches: list  # GraphKVCache per block
    position: torch.Tensor  # [1] long
    step: Any  # the compiled _graph_step


_STEP_BUFFERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its last _StepBuffers


def _step_buffers(model, caches: list, options: dict) -> _StepBuffers:
    """The model's step buffers for caches shaped as ``caches`` (new ones, marked
    static, when the shapes differ from the last call's)."""
    key = (tuple((tuple(c.k.shape), tuple(c.v.shape), c.k.dtype) for c in caches), caches[0].k.device,
           tuple(sorted(options.items())))  # fmt: skip
    state = _STEP_BUFFERS.get(model)
    if state is None or state.key != key:
        _STEP_BUFFERS.pop(model, None)  # free the old buffers first
        position = torch.zeros(1, dtype=torch.long, device=caches[0].k.device)
        graph_caches = [GraphKVCache(_empty_like(c), position) for c in caches]
        for t in (position, *(b for c in graph_caches for b in (c.k, c.v))):
            torch._dynamo.mark_static_address(t, guard=False)
        step = torch.compile(_graph_step, fullgraph=True, **options)
        state = _STEP_BUFFERS[model] = _StepBuffers(key, graph_caches, position, step)
    return state


def _empty_like(cache: KVCache) -> KVCache:
    """A new ``KVCache`` with buffers shaped as ``cache``'s."""
    B, G, S, D = cache.k.shape
    return KVCache(B, G, S, D, value_dim=cache.v.shape[3], value_heads=cache.v.shape[1], dtype=cache.k.dtype,
                   device=cache.k.device)  # fmt: skip


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
