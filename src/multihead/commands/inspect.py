"""``multihead inspect "TEXT"``: what every head of a real model attends to.

Loads the pretrained MiniLM encoder (default) or a GPT checkpoint, runs the
text through it while capturing every head's exact weights, scores each head
for the documented roles (``tools.roles``), prints a table of heads with
their roles and strongest token links, and writes three files:

    heads.html   head view, model view and role table (one self-contained page)
    heads.png    layers x heads grid of heatmaps
    heads.json   the record (weights and tokens) plus the roles
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from ..tools.capture import AttentionRecord, capture
from ..tools.roles import HeadRoles, classify_heads, format_roles

__all__ = ["DEFAULT_TEXT", "Inspection", "inspect_text", "run"]

DEFAULT_TEXT = "The law will never be perfect, but its application should be just."
MODELS = ("minilm-l6",)


@dataclass
class Inspection:
    """Everything ``inspect_text`` found: the record, token ids and roles."""

    record: AttentionRecord
    token_ids: list[int]
    roles: list[HeadRoles]


def _byte_token(b: int) -> str:
    """A readable label for one byte of a byte-level model."""
    return chr(b) if 32 <= b < 127 else f"\\x{b:02x}"


def _run_minilm(text: str) -> tuple[AttentionRecord, list[int]]:
    from ..models.minilm import load_minilm

    model = load_minilm()
    batch = model.tokenize([text])
    with torch.no_grad(), capture(model.encoder) as record:
        model.encoder(batch.input_ids, attention_mask=batch.attention_mask)
    record.query_tokens = list(batch.tokens[0])
    record.source = "all-MiniLM-L6-v2"
    return record, batch.input_ids[0].tolist()


def _run_gpt(text: str, checkpoint: str, tokenizer: str | None) -> tuple[AttentionRecord, list[int]]:
    from ..models.checkpoint import load_checkpoint

    model = load_checkpoint(checkpoint).eval()
    if tokenizer is not None:
        from tokenizers import Tokenizer

        encoding = Tokenizer.from_file(tokenizer).encode(text)
        ids, tokens = list(encoding.ids), list(encoding.tokens)
    elif model.config.vocab_size == 256:
        ids = list(text.encode("utf-8"))
        tokens = [_byte_token(b) for b in ids]
    else:
        raise ValueError(
            f"the checkpoint's vocabulary has {model.config.vocab_size} tokens, not 256 bytes: "
            "pass --tokenizer tokenizer.json"
        )
    if not ids:
        raise ValueError("the text is empty: nothing to inspect")
    limit = model.config.context_length
    if len(ids) > limit:
        raise ValueError(f"the text is {len(ids)} tokens, longer than the model's context_length={limit}")
    with torch.no_grad(), capture(model) as record:
        model(torch.tensor([ids]))
    record.query_tokens = tokens
    record.source = f"GPT checkpoint {Path(checkpoint).name}"
    return record, ids


def inspect_text(
    text: str,
    *,
    model: str = "minilm-l6",
    checkpoint: str | None = None,
    tokenizer: str | None = None,
    layer: int | None = None,
) -> Inspection:
    """Capture and classify every head on ``text``.

    Args:
        text: the input sentence.
        model: a packaged pretrained model name (``MODELS``), used unless
            ``checkpoint`` is given.
        checkpoint: a GPT checkpoint (``multihead.models.save_checkpoint``).
        tokenizer: a tokenizer.json for a checkpoint whose vocabulary is not bytes.
        layer: keep only this layer.

    Raises:
        ValueError: unknown model, empty or too long text, layer out of range.
    """
    if checkpoint is not None:
        record, ids = _run_gpt(text, checkpoint, tokenizer)
    elif model in MODELS:
        record, ids = _run_minilm(text)
    else:
        raise ValueError(f"unknown model {model!r}; packaged models: {list(MODELS)} (or pass --checkpoint)")
    if layer is not None:
        if not 0 <= layer < record.num_layers:
            raise ValueError(f"--layer {layer} out of range: the model has layers 0..{record.num_layers - 1}")
        record.layers = [record.layers[layer]]
    return Inspection(record, ids, classify_heads(record, token_ids=ids))


def _links_table(roles: list[HeadRoles]) -> str:
    lines = ["", "strongest token links per head (query -> key: weight)"]
    for r in roles:
        links = ", ".join(f"{link.query} -> {link.key}: {link.weight:.2f}" for link in r.links)
        lines.append(f"  L{r.layer:<2} H{r.head:<2} {links}")
    return "\n".join(lines)


def run(
    text: str,
    *,
    model: str = "minilm-l6",
    checkpoint: str | None = None,
    tokenizer: str | None = None,
    layer: int | None = None,
    out: str = "out",
    echo: Callable[[str], None] = print,
) -> dict[str, Path]:
    """The CLI command: print roles and links, write the three files.

    Returns:
        {"html": ..., "png": ..., "json": ...} paths written.
    """
    from ..tools.visualize import write_html, write_json, write_png

    found = inspect_text(text, model=model, checkpoint=checkpoint, tokenizer=tokenizer, layer=layer)
    record, roles = found.record, found.roles
    echo(f"{record.source}: {record.num_layers} layers x {record.layers[0].num_heads} heads on")
    echo(f"  {' '.join(record.query_tokens)}")
    echo("")
    echo(format_roles(roles))
    echo(_links_table(roles))
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    title = f"{record.source}: {text}"
    paths = {
        "html": write_html(record, folder / "heads.html", roles=roles, title=title),
        "png": write_png(record, folder / "heads.png", roles=roles),
        "json": write_json(record, folder / "heads.json", roles=roles),
    }
    echo("")
    for kind, path in paths.items():
        echo(f"wrote {kind:<4} {path.resolve()}")
    return paths
