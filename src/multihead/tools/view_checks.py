"""The checks of ``visualize``'s writers: the record, the chosen batch item, roles, legend, slots, the path.

Each raises the user's mistake as one TypeError/ValueError (or FileNotFoundError
for a missing folder) naming the offending value, before anything is drawn.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
from collections.abc import Mapping
from pathlib import Path

from .._checks import non_negative_int
from .capture import AttentionRecord
from .head_slots import HeadSlots

__all__ = ["folder_of", "validate", "check_slots", "strings", "match_roles", "legend_entries"]


def folder_of(path: str | os.PathLike) -> None:
    """Refuse ``path`` when its folder does not exist (or is not a folder), before any work."""
    folder = Path(path).absolute().parent
    if not folder.exists():
        raise FileNotFoundError(f"cannot write {os.fspath(path)}: the folder {folder} does not exist")
    if not folder.is_dir():
        raise NotADirectoryError(f"cannot write {os.fspath(path)}: {folder} is not a folder")


def validate(record: AttentionRecord, batch: int) -> tuple[AttentionRecord, tuple[list[str], list[str]]]:
    """Batch item ``batch`` of ``record`` alone (``AttentionRecord.item``: weights [1, H, T, S],
    its tokens, no padding) and its query and key token strings, after checking the shapes."""
    if not isinstance(record, AttentionRecord):
        raise TypeError(f"record must be an AttentionRecord, got {type(record).__name__}")
    if not record.layers:
        raise ValueError("the record is empty (no layers): run the model inside `with capture(model)` first")
    record.require_whole("the views")
    record = record.item(non_negative_int("batch", batch))
    first = None
    for entry in record.layers:
        _, H, T, S = entry.weights.shape
        if min(H, T, S) == 0:
            raise ValueError(f"layer {entry.layer} ({entry.name}) has an empty dimension: H={H}, T={T}, S={S}")
        if first is None:
            first = (entry, T, S)
        elif (T, S) != first[1:]:
            raise ValueError(
                f"layer {entry.layer} ({entry.name}) has T={T}, S={S} but layer {first[0].layer} has "
                f"T={first[1]}, S={first[2]}; the views need one token sequence (capture one forward pass)"
            )
    _, T, S = first
    queries = record.query_tokens
    keys = record.key_tokens if record.key_tokens is not None else queries
    queries = [str(i) for i in range(T)] if queries is None else strings("query_tokens", queries)
    keys = [str(j) for j in range(S)] if keys is None else strings("key_tokens", keys)
    if len(queries) != T:
        raise ValueError(f"query_tokens has {len(queries)} tokens but the weights have T={T} queries")
    if len(keys) != S:
        source = "key_tokens" if record.key_tokens is not None else "key_tokens (defaulting to query_tokens)"
        raise ValueError(f"{source} has {len(keys)} tokens but the weights have S={S} keys")
    return record, (queries, keys)


def check_slots(slots, record: AttentionRecord) -> None:
    """``slots`` is None or a HeadSlots whose kept heads are the record's heads, layer by layer."""
    if slots is None:
        return
    if not isinstance(slots, HeadSlots):
        raise TypeError(f"slots must be a HeadSlots, got {type(slots).__name__}")
    for entry in record.layers:
        kept = sum(h is not None for h in slots.slots(entry.layer))
        if kept != entry.num_heads:
            raise ValueError(
                f"slots keep {kept} heads in layer {entry.layer}, "
                f"but the record's layer {entry.layer} has {entry.num_heads}"
            )


def strings(name: str, tokens) -> list[str]:
    if isinstance(tokens, str) or not isinstance(tokens, (list, tuple)):
        raise TypeError(f"{name} must be a list of str, got {type(tokens).__name__}")
    for i, token in enumerate(tokens):
        if not isinstance(token, str):
            raise TypeError(f"{name}[{i}] must be a str, got {token!r} ({type(token).__name__})")
    return list(tokens)


def match_roles(roles, record: AttentionRecord) -> list[tuple[int, dict]]:
    """(row in record.layers, clean role dict) for each role, in the given order."""
    if roles is None:
        return []
    if isinstance(roles, (str, bytes, Mapping)) or not hasattr(roles, "__iter__"):
        raise TypeError(f"roles must be a list of dicts (layer, head, labels, scores), got {type(roles).__name__}")
    calls: dict[int, list[int]] = {}
    for row, entry in enumerate(record.layers):
        calls.setdefault(entry.layer, []).append(row)
    seen: dict[tuple[int, int], int] = {}
    out = []
    for i, item in enumerate(roles):
        role = role_dict(i, item)
        layer, head = role["layer"], role["head"]
        if layer not in calls:
            raise ValueError(f"roles[{i}] has layer={layer}, but the record's layers are {sorted(calls)}")
        k = seen.get((layer, head), 0)
        if k >= len(calls[layer]):
            raise ValueError(
                f"roles[{i}] repeats layer={layer}, head={head}: the record has {len(calls[layer])} call(s) of that layer"
            )
        seen[(layer, head)] = k + 1
        row = calls[layer][k]
        heads = record.layers[row].num_heads
        if head >= heads:
            raise ValueError(f"roles[{i}] has head={head}, but layer {layer} has {heads} heads")
        out.append((row, role))
    return out


def role_dict(i: int, item) -> dict:
    """A JSON-ready {"layer", "head", "labels", "scores"} (and "chance" when given) from a mapping or an object."""
    if dataclasses.is_dataclass(item) and not isinstance(item, type):
        item = {f.name: getattr(item, f.name) for f in dataclasses.fields(item)}
    get = item.get if isinstance(item, Mapping) else (lambda key, default=None: getattr(item, key, default))
    layer, head = get("layer"), get("head")
    if layer is None or head is None:
        raise TypeError(f"roles[{i}] needs 'layer' and 'head', got {item!r:.100}")
    labels = get("labels") or []
    if isinstance(labels, str):
        labels = [labels]
    if not all(isinstance(label, str) for label in labels):
        raise TypeError(f"roles[{i}]['labels'] must be a list of str, got {labels!r:.100}")
    scores = get("scores") or {}
    if not isinstance(scores, Mapping):
        raise TypeError(f"roles[{i}]['scores'] must be a dict of name -> number, got {type(scores).__name__}")
    scores = {str(k): number(f"roles[{i}]['scores'][{k!r}]", v) for k, v in scores.items()}
    for extra, key in (("entropy", "entropy"), ("mean_distance", "distance")):  # HeadRoles fields
        if get(extra) is not None and key not in scores:
            scores[key] = number(f"roles[{i}][{extra!r}]", get(extra))
    out = {
        "layer": non_negative_int(f"roles[{i}]['layer']", layer),
        "head": non_negative_int(f"roles[{i}]['head']", head),
        "labels": list(labels),
        "scores": scores,
    }
    chance = get("chance") or {}  # HeadRoles: what an even head scores, the baseline a role must beat
    if not isinstance(chance, Mapping):
        raise TypeError(f"roles[{i}]['chance'] must be a dict of name -> number, got {type(chance).__name__}")
    if chance:
        out["chance"] = {str(k): number(f"roles[{i}]['chance'][{k!r}]", v) for k, v in chance.items()}
    if get("evidence") is not None:  # roles over a corpus (corpus_roles.CorpusHeadRoles.to_dict)
        out.update(_corpus_fields(i, get))
    return out


def _corpus_fields(i: int, get) -> dict:
    """"spread" (name -> sd), "interval" (name -> [low, high]), "evidence" (name -> {"texts", "rows",
    "keys", "enough"}), "texts" and "withheld" of a role over a corpus, checked."""
    out: dict = {}
    for key in ("spread", "interval", "evidence"):
        value = get(key) or {}
        if not isinstance(value, Mapping):
            raise TypeError(f"roles[{i}][{key!r}] must be a dict keyed by score name, got {type(value).__name__}")
        out[key] = {}
        for name, v in value.items():
            where = f"roles[{i}][{key!r}][{name!r}]"
            if key == "spread":
                out[key][str(name)] = number(where, v)
            elif key == "interval":
                if not isinstance(v, (list, tuple)) or len(v) != 2:
                    raise TypeError(f"{where} must be [low, high], got {v!r:.60}")
                out[key][str(name)] = [number(where, x) for x in v]
            else:
                if not isinstance(v, Mapping):
                    raise TypeError(f"{where} must be a dict with texts, rows, keys, enough; got {v!r:.60}")
                counts = {c: None if v.get(c) is None else non_negative_int(f"{where}[{c!r}]", v.get(c))
                          for c in ("texts", "rows", "keys")}  # fmt: skip
                enough = v.get("enough")
                if enough is not None and not isinstance(enough, bool):
                    raise TypeError(f"{where}['enough'] must be true, false or null, got {enough!r}")
                out[key][str(name)] = {**counts, "enough": enough}
    out["texts"] = non_negative_int(f"roles[{i}]['texts']", get("texts") or 0)
    withheld = get("withheld") or []
    if isinstance(withheld, str) or not all(isinstance(w, str) for w in withheld):
        raise TypeError(f"roles[{i}]['withheld'] must be a list of str, got {withheld!r:.100}")
    out["withheld"] = list(withheld)
    return out


def legend_entries(legend) -> dict[str, dict] | None:
    """{column: {"meaning": str, "threshold": float or None}} from a mapping of str or of dicts."""
    if legend is None:
        return None
    if not isinstance(legend, Mapping):
        raise TypeError(f"legend must be a dict of column -> meaning, got {type(legend).__name__}")
    out = {}
    for name, entry in legend.items():
        if not isinstance(name, str):
            raise TypeError(f"legend keys must be column names (str), got {name!r}")
        if isinstance(entry, str):
            entry = {"meaning": entry}
        if not isinstance(entry, Mapping) or not isinstance(entry.get("meaning"), str):
            raise TypeError(f"legend[{name!r}] must be a str or a dict with a str 'meaning', got {entry!r:.100}")
        out[name] = {"meaning": entry["meaning"], "threshold": number(f"legend[{name!r}]['threshold']", entry.get("threshold"))}
    return out


def number(name: str, value) -> float | None:
    """A finite float, or None for None/NaN/inf (JSON has neither)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {value!r}")
    return float(value) if math.isfinite(value) else None


def causal_entries(causal) -> dict:
    """A causal model's role scores for the page and heads.json, checked: a mapping with "roles"
    (a list of {"name": str, "meaning": str, "threshold", "chance"}) and "scores" (name -> rows of numbers or None)."""
    if not isinstance(causal, Mapping):
        raise TypeError(f"causal must be a dict (inspect_causal.causal_view), got {type(causal).__name__}")
    roles, scores = causal.get("roles"), causal.get("scores")
    if not isinstance(roles, list) or not isinstance(scores, Mapping):
        raise TypeError("causal needs a 'roles' list and a 'scores' dict")
    for role in roles:
        if not isinstance(role, Mapping) or not all(isinstance(role.get(k), str) for k in ("name", "meaning")):
            raise TypeError(f"each causal role needs a str 'name' and 'meaning', got {role!r}")
        if role["name"] not in scores:
            raise ValueError(f"causal role {role['name']!r} has no scores; scored: {sorted(scores)}")
    return dict(causal)
