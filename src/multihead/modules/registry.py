"""Attention kinds by name: ``build_attention("gqa", embed_dim=..., num_heads=...)``.

Models choose their attention by name (``GPTConfig(attention="mqa")``), so
the same model compares attention kinds. Every kind is a subclass of
``base.AttentionLayer`` and so has the same interface:

    forward(query, key=None, value=None, *, attn_mask=None,
            key_mask=None, is_causal=False, return_weights=False,
            kv_cache=None, positions=None) -> out [B, T, C] (or (out, weights))
    make_kv_cache(batch_size, max_len) -> cache for ``kv_cache=``
    aux_loss() -> the training loss term of the last forward, 0-d
    cost(T, S) -> FLOPs, parameters, cache bytes
    out_proj -> the output projection (models initialise it)
    kind -> the registry name (a str attribute)

``kind`` is a class attribute of every attention class (``MoHAttention.kind
== "moh"``), never a property. A class that serves several names sets the
instance's name in ``__init__`` as a plain attribute over its class
attribute's family name: ``MultiHeadAttention.kind == "mha"``, and an instance
with num_kv_heads == 1 has ``kind == "mqa"``, with 1 < num_kv_heads <
num_heads ``"gqa"``. The instance's ``kind`` is the name observers' events
carry; it is the name the module was built by, except that a configuration
another name describes exactly carries that name (``build_attention("gqa",
num_kv_heads=num_heads)`` is an "mha").

``aux_loss()`` is a method on every kind: the loss term the last forward
asks the training loop to add (MoH's weighted load-balance loss, the gated
kind's L0 penalty), with its gradient; a 0-d zero on the module's device and
dtype for kinds without one and after an eval-mode forward. Models
(``GPT``, ``BertEncoder``, ``Transformer``) sum it over their attention
modules with :func:`total_aux_loss`; a training loop adds
``model.aux_loss()`` to its loss.

Kinds register themselves with ``@register_attention(name)`` in their own
module, and that is the only way a name enters the registry: importing
``multihead.modules`` (which ``multihead.build_attention`` and every model
import) imports every kind's module, so every kind is registered before
anything can be built. An unknown name raises
ValueError listing the known ones; a name registered twice is refused.

A kind's options are the keyword parameters of its builder and class
``__init__``, followed through ``**options`` up the classes it passes them
to (a kind's own, then ``AttentionLayer``'s shared ones), less the shared
ones it names in ``refused_options``: :func:`kind_options` lists them, and
``build_attention`` refuses a name outside them with a TypeError that lists
them and suggests the nearest (``num_kv_head`` -> ``num_kv_heads``) before
the kind sees it.

The decorator goes on the kind's class (built as ``cls(embed_dim=...,
num_heads=..., **options)``) or on a builder function together with the
class it builds (``@register_attention("gqa", MultiHeadAttention)``), so
:func:`attention_class` answers what a kind can do (``independent_heads``,
``comparison_options``, ...) without building one.

Kinds from outside the package: a distribution that declares an entry point
in the group ``multihead.attention_kinds`` (any name, pointing at a module)
has that module imported when ``multihead.modules`` is imported (every model,
``multihead.build_attention`` and the commands import it;
:func:`load_entry_point_kinds`); the module registers its kinds as above.
"""

from __future__ import annotations

import difflib
import inspect
import warnings
from collections.abc import Callable, Iterable
from importlib.metadata import entry_points

import torch
from torch import nn

__all__ = [
    "build_attention",
    "register_attention",
    "list_attention_kinds",
    "attention_class",
    "check_kind",
    "kind_options",
    "check_kind_options",
    "load_entry_point_kinds",
    "total_aux_loss",
    "ENTRY_POINT_GROUP",
]

ENTRY_POINT_GROUP = "multihead.attention_kinds"

Builder = Callable[..., nn.Module]
_KINDS: dict[str, tuple[Builder, type]] = {}


def register_attention(name: str, cls: type | None = None) -> Callable[[Builder], Builder]:
    """Decorator: register a kind's class, or ``builder(*, embed_dim, num_heads, **options)``
    together with the class ``cls`` it builds.

    Raises:
        TypeError: an empty or non-str name, or a builder function without ``cls``.
        ValueError: ``name`` already registered by another builder.
    """

    if not isinstance(name, str) or not name:
        raise TypeError(f"an attention kind's name must be a non-empty str, got {name!r}")

    def deco(builder: Builder) -> Builder:
        kind_class = builder if isinstance(builder, type) else cls
        if not isinstance(kind_class, type):
            raise TypeError(
                f"register_attention({name!r}) on the function {builder.__qualname__} needs the class it builds: "
                f"@register_attention({name!r}, TheKindClass)"
            )
        if name in _KINDS and _KINDS[name][0] is not builder:
            raise ValueError(f"attention kind {name!r} is already registered by {_KINDS[name][0].__qualname__}")
        _KINDS[name] = (builder, kind_class)
        return builder

    return deco


def list_attention_kinds() -> list[str]:
    """The names ``build_attention`` accepts, sorted."""
    return sorted(_KINDS)


def check_kind(name: object) -> str:
    """``name`` if it is a registered kind.

    Raises:
        ValueError: an unknown name; the message lists the known ones and
            says how a kind from the user's own package is registered.
    """
    if not isinstance(name, str) or name not in _KINDS:
        raise ValueError(
            f"unknown attention kind {name!r}; known: {list_attention_kinds()}. A kind defined in your own "
            "module is registered when that module is imported: import it first (on the command line "
            f"--import MODULE), or declare it as an entry point in the group {ENTRY_POINT_GROUP!r}"
        )
    return name


def attention_class(name: str) -> type:
    """The class a registered kind builds (its capabilities are attributes of it).

    Raises:
        ValueError: an unknown name (see :func:`check_kind`).
    """
    return _KINDS[check_kind(name)][1]


# what the caller of a builder always gives; not an option
_CALL_ARGUMENTS = ("self", "embed_dim", "num_heads")


def _keywords(function: Callable) -> tuple[set[str], bool]:
    """(the keyword parameter names of ``function``, whether it also takes ``**``)."""
    names, rest = set(), False
    for p in inspect.signature(function).parameters.values():
        if p.kind is inspect.Parameter.VAR_KEYWORD:
            rest = True
        elif p.kind in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD):
            names.add(p.name)
    return names, rest


def _all_options(name: str) -> set[str] | None:
    """Every keyword the kind ``name`` takes, refused ones included; None when
    a ``**options`` leaves the classes (then any name may be meant)."""
    builder, cls = _KINDS[check_kind(name)]
    names: set[str] = set()
    if not isinstance(builder, type):
        names, rest = _keywords(builder)
        if not rest:
            return names - set(_CALL_ARGUMENTS)
    for klass in cls.__mro__:
        if klass is nn.Module or klass is object:
            return None  # a ** that no class of the kind names: it may use any name itself
        if "__init__" not in vars(klass):
            continue
        own, rest = _keywords(klass.__init__)
        names |= own
        if not rest:
            return names - set(_CALL_ARGUMENTS)
    return None  # pragma: no cover - every class's MRO ends in object


def kind_options(name: str) -> list[str] | None:
    """The options ``build_attention(name, embed_dim=..., num_heads=..., **options)``
    takes, sorted: the keyword parameters of the kind's builder and classes
    (see the module docstring) less its ``refused_options``. None for a kind
    whose ``**options`` go beyond its classes (any name may be meant).

    Raises:
        ValueError: an unknown kind.
    """
    names = _all_options(name)
    if names is None:
        return None
    refused = set(getattr(attention_class(name), "refused_options", ()))
    return sorted(names - refused)


def check_kind_options(name: str, options: Iterable[str]) -> None:
    """Refuse option names the kind ``name`` does not take (before building it).

    A shared option the kind refuses (``refused_options``) passes here: the
    kind itself says why it does not take it.

    Raises:
        ValueError: an unknown kind.
        TypeError: an unknown option; the message lists the kind's options
            and suggests the nearest name.
    """
    known = _all_options(name)
    if known is None:
        return
    unknown = [key for key in options if key not in known and key not in _CALL_ARGUMENTS]
    if not unknown:
        return
    valid = kind_options(name) or []
    hints = []
    for key in unknown:
        close = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
        hints.append(f"{key!r} (did you mean {close[0]!r}?)" if close else repr(key))
    noun = "option" if len(unknown) == 1 else "options"
    raise TypeError(f"attention kind {name!r} has no {noun} {', '.join(hints)}; its options: {', '.join(valid)}")


def build_attention(name: str, *, embed_dim: int, num_heads: int, **options) -> nn.Module:
    """Build the attention kind ``name``.

    Raises:
        ValueError: unknown name (the message lists the known ones) or
            options the kind rejects.
        TypeError: an option the kind does not take (see
            :func:`check_kind_options`).
    """
    check_kind_options(name, options)
    return _KINDS[check_kind(name)][0](embed_dim=embed_dim, num_heads=num_heads, **options)


def load_entry_point_kinds() -> list[str]:
    """Import every module declared in the entry-point group ``multihead.attention_kinds``.

    Returns:
        the entry points' names, in the order loaded. One that fails to
        import is skipped with a warning naming it and the error (a broken
        plug-in never stops ``import multihead``); its kinds stay unknown.
    """
    loaded = []
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        try:
            ep.load()
        except Exception as exc:  # a third-party module: report, do not fail multihead's import
            warnings.warn(
                f"multihead: the attention-kind entry point {ep.name!r} ({ep.value}) failed to import: "
                f"{type(exc).__name__}: {exc}",
                stacklevel=2,
            )
            continue
        loaded.append(ep.name)
    return loaded


def total_aux_loss(modules: Iterable[nn.Module], like: torch.Tensor) -> torch.Tensor:
    """Sum of ``m.aux_loss()`` over attention ``modules``, with its gradient.

    Args:
        modules: attention modules (each has the ``aux_loss()`` method).
        like: a tensor whose device and dtype the 0-d zero start takes.

    Returns:
        A 0-d tensor: 0 + the modules' terms (exactly 0 when there is none).
    """
    total = torch.zeros((), device=like.device, dtype=like.dtype)
    for m in modules:
        total = total + m.aux_loss()
    return total

