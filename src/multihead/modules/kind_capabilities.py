"""What an attention kind declares on its class, and the head selection built on it.

``AttentionLayer`` (``modules.base``) inherits :class:`KindCapabilities`, so a
kind states here, once, what it is and what it can do; tools, training and
the parallel code ask the class (``multihead.attention_class(name)``) and
keep no list of kinds. docs/adding-a-kind.md has the same table for readers.
"""

from __future__ import annotations

from .head_selection import check_head_selection
from .score_options import keep_head_slopes, rebuilt_without_slopes

__all__ = ["KindCapabilities"]


class KindCapabilities:
    """The class attributes of an attention kind, and ``select_heads`` /
    ``tensor_parallel_part``, which read them.

    Class attributes a kind sets:
        kind: its registry name.
        backends: the ``backend`` values its core accepts (None: any that
            ``functional.attention`` accepts).
        forward_options: names of extra keyword arguments of ``forward``
            that go to its ``core`` (e.g. MoH's ``path``).
        refused_options: options it inherits but does not take: shared ones
            (e.g. ("kdim", "vdim") for a kind with one fused projection) or
            a parent kind's (``registry.kind_options`` leaves them out).

    Capabilities a kind declares (the kind contract test checks them for
    every registered kind; no other file keeps a list of kinds):
        independent_heads: True when a head can be removed, or placed on
            another device, on its own (a key/value head only with its whole
            group): the layer's output is a sum over heads of
            ``out_proj`` columns times that head's context, and nothing else
            couples them. Such a kind implements ``subset_heads(heads,
            kv_heads)`` (checked, ascending lists; it returns the smaller
            layer, ``head_selection.load_selected`` fills a copy built on the
            meta device), which ``select_heads`` calls; a class that claims
            independent heads without it is refused when it is defined.
        head_independence: one sentence saying why heads are, or are not,
            independent (the reason ``select_heads`` gives when refusing).
        comparison_skip: None, or the reason the kind stays out of
            ``multihead compare``'s default list.
        weight_only_layers: True when every projection is an ``nn.Linear`` the
            kind calls as a module (never reading its ``.weight``), so
            ``models.quantize_weights`` may swap in bfloat16/int8 layers.
        layer_index_option: None, or the name of the constructor option that
            takes the layer's index in its stack (differential attention's
            ``depth``); models fill it per layer unless the user set it.
        comparison_options(kind, num_heads): classmethod, the options a
            comparison builds the registered name ``kind`` with.
        regroups_key_values: the keys and values are plain projections of the
            input, one per key/value head, read by groups of query heads, so
            ``tools.to_gqa`` may merge them and ``tools.to_mla`` factor them
            into a latent. A subclass that does not say so itself gets False.
        selects_weights: ``core`` takes a ``WeightSelection`` as ``return_weights``
            and returns just those weights (the default core). A class defining
            ``core`` gets False unless it says so: asked for every weight.
        self_attention_options: the constructor options that place queries and
            keys on one position axis (rope, ALiBi, a window); a cross-attention
            call has no such axis, so models build cross-attention layers without them.
    """

    kind = "attention"
    backends: tuple[str, ...] | None = None
    forward_options: tuple[str, ...] = ()
    refused_options: tuple[str, ...] = ()
    independent_heads: bool = False
    head_independence: str = ""
    comparison_skip: str | None = None
    layer_index_option: str | None = None
    weight_only_layers: bool = False
    regroups_key_values: bool = False
    selects_weights: bool = True
    self_attention_options: tuple[str, ...] = ("rope", "alibi", "window")

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if cls.independent_heads and not callable(getattr(cls, "subset_heads", None)):
            raise TypeError(f"{cls.__name__} declares independent_heads = True but defines no subset_heads")
        if "regroups_key_values" not in cls.__dict__:
            cls.regroups_key_values = False  # a subclass may change how keys and values are formed
        if "core" in cls.__dict__ and "selects_weights" not in cls.__dict__:
            cls.selects_weights = False  # a core of its own: asked for every weight

    @classmethod
    def comparison_options(cls, kind: str, num_heads: int) -> dict:
        """The options ``multihead compare`` builds the registered name ``kind``
        with at ``num_heads`` heads (default: none, the kind's defaults)."""
        return {}

    def select_heads(self, heads, kv_heads=None) -> KindCapabilities:
        """A new layer of the same kind holding only the query heads ``heads``.

        Kept heads keep their order and are renumbered 0 .. H'-1; key/value
        heads go with their groups (``head_selection`` draws the rule);
        ``out_proj``'s input columns follow the heads, its bias stays.
        Per-head parameters of the kind travel with their heads. On any
        input the new layer's output equals this layer's with the other
        heads masked (``tools.heads.mask_heads``), up to float rounding. The
        new layer has this one's dtype, device, requires_grad flags and
        training mode, and no observers or hooks.

        Args:
            heads: query heads to keep (at least one, each once).
            kv_heads: key/value heads to keep, or None for the groups the
                kept query heads read (given, it must be exactly those).

        Raises:
            ValueError: a kind whose heads are not independent (the message
                says why), an index out of range or repeated, or GQA groups
                that would keep different numbers of query heads.
            TypeError: indices that are not ints.
        """
        if not self.independent_heads:
            raise ValueError(f"{self.kind!r} attention cannot keep a subset of its heads: {self.head_independence}")
        keep_q, keep_kv = check_head_selection(heads, kv_heads, self.num_heads, self.num_kv_heads)
        with rebuilt_without_slopes(self):
            new = self.subset_heads(keep_q, keep_kv)
        return keep_head_slopes(new, self, keep_q)

    def tensor_parallel_part(self, heads: list[int]) -> KindCapabilities:
        """The part of this layer that one tensor-parallel rank computes: the
        contribution of the query heads ``heads`` (a contiguous block) to the
        output, so that the parts of a partition of the heads sum to the
        layer's output (``multihead.parallel``). It only selects: every
        parameter of the part is elements of this layer's.

        Independent heads split as :meth:`select_heads` keeps them. A kind
        whose heads are coupled may still say how its heads split (Mixture-of-
        Head keeps its router whole); the others refuse with their reason.

        Raises:
            ValueError: a kind whose heads cannot be split (its reason), or
                a selection ``select_heads`` refuses.
        """
        if not self.independent_heads:
            raise ValueError(f"{self.kind!r} attention cannot be split by heads: {self.head_independence}")
        return self.select_heads(heads)
