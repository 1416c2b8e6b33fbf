"""A kind from the user's own module reaches every command, with no file of multihead edited.

The kind lives in ``mean_query_heads.py`` in a temporary folder outside
``src/`` and subclasses ``AttentionLayer`` as docs/adding-a-kind.md shows:
each head's query is its own plus the mean query of all heads, so its heads
are coupled and it says so (``independent_heads = False``). Every command
runs in a fresh interpreter (``python -m multihead``) whose current folder
holds the module, the way a user runs them:

    train --import       trains a run of the kind
    compare --import     runs it beside MHA in a quick comparison
    prune --import       is refused with the reason the kind declares
    inspect --import     captures its heads from the run's checkpoint
    inspect (no import)  says which kind is missing and how to provide it
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

KIND = '''
"""Heads whose queries share their mean: q_h + mean_h' q_h'."""

import torch
from torch import nn

from multihead.modules.base import AttentionLayer
from multihead.modules.cost import AttentionCost, visible_pairs
from multihead.modules.registry import register_attention


@register_attention("mean_query_heads")
class MeanQueryHeads(AttentionLayer):
    kind = "mean_query_heads"
    head_independence = "every head's query adds the mean query of all heads, so each head depends on the others"

    def __init__(self, embed_dim, num_heads, **options):
        super().__init__(embed_dim, num_heads, **options)
        H, G, D = self.num_heads, self.num_kv_heads, self.head_dim
        self.q_proj = nn.Linear(embed_dim, H * D, bias=self.qkv_bias, **self.factory)
        self.k_proj = nn.Linear(self.kdim, G * D, bias=self.qkv_bias, **self.factory)
        self.v_proj = nn.Linear(self.vdim, G * D, bias=self.qkv_bias, **self.factory)
        self.init_output(H * D, embed_dim)
        self.init_positions(D)

    def project(self, query, key=None, value=None):
        key = query if key is None else key
        value = key if value is None else value
        (B, T, _), S = query.shape, key.shape[1]
        H, G, D = self.num_heads, self.num_kv_heads, self.head_dim
        q = self.q_proj(query).view(B, T, H, D).transpose(1, 2)  # (B, T, H*D) -> (B, H, T, D)
        k = self.k_proj(key).view(B, S, G, D).transpose(1, 2)  # (B, S, G*D) -> (B, G, S, D)
        v = self.v_proj(value).view(B, S, G, D).transpose(1, 2)  # (B, S, G*D) -> (B, G, S, D)
        return q + q.mean(dim=1, keepdim=True), k, v

    def cost(self, T, S=None, *, batch=1, causal=False, bytes_per_element=2):
        S = T if S is None else S
        H, G, D, C = self.num_heads, self.num_kv_heads, self.head_dim, self.embed_dim
        core = 2 * batch * H * visible_pairs(T, S, causal=causal) * (D + D)
        proj = 2 * batch * (T * C * H * D + S * (self.kdim + self.vdim) * G * D + T * H * D * C)
        return AttentionCost(core, proj, sum(p.numel() for p in self.parameters()), 2 * G * D * bytes_per_element)
'''
TEXT = "to be or not to be that is the question whether tis nobler in the mind to suffer\n" * 100
TINY = ["--preset", "tiny", "--context-length", "32", "--batch-size", "4", "--eval-batches", "2", "--warmup", "1",
        "--threads", "1", "--max-steps", "2", "--eval-every", "2", "--checkpoint-every", "2"]  # fmt: skip


def _multihead(folder: Path, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "multihead", *argv], cwd=folder, capture_output=True, text=True,
                          timeout=600)  # fmt: skip


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """The user's folder: the kind's module, a text, and a run trained with --import."""
    here = tmp_path_factory.mktemp("user")
    (here / "mean_query_heads.py").write_text(textwrap.dedent(KIND))
    (here / "text.txt").write_text(TEXT)
    done = _multihead(here, "train", "--import", "mean_query_heads", "--attention", "mean_query_heads",
                      "--data", "text.txt", *TINY, "--out", "run")  # fmt: skip
    assert done.returncode == 0, done.stderr
    return here


def test_train_saves_a_run_that_names_the_kind(folder):
    config = json.loads((folder / "run" / "config.json").read_text())
    assert config["attention"] == "mean_query_heads"
    assert "multihead" not in str((folder / "mean_query_heads.py").resolve().parent)  # outside the package


def test_compare_runs_the_kind_beside_mha(folder):
    done = _multihead(folder, "compare", "--import", "mean_query_heads", "--quick", "--attention",
                      "mha,mean_query_heads", "--data", "text.txt", "--out", "cmp")  # fmt: skip
    assert done.returncode == 0, done.stderr
    report = json.loads((folder / "cmp" / "compare.json").read_text())
    assert "mean_query_heads" in json.dumps(report)
    assert (folder / "cmp" / "mean_query_heads-seed0" / "metrics.jsonl").is_file()


def test_prune_is_refused_with_the_reason_the_kind_declares(folder):
    done = _multihead(folder, "prune", "--import", "mean_query_heads", "--checkpoint", "run", "--method",
                      "gradient", "--keep", "0.5", "--out", "pruned")  # fmt: skip
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr
    assert "cannot lose one head alone: every head's query adds the mean query of all heads" in lines[0]
    assert not (folder / "pruned").exists()


def test_the_head_explorer_captures_the_kinds_heads(folder):
    done = _multihead(folder, "inspect", "to be or not", "--import", "mean_query_heads", "--checkpoint", "run",
                      "--out", "heads")  # fmt: skip
    assert done.returncode == 0, done.stderr
    heads = json.loads((folder / "heads" / "heads.json").read_text())
    assert "mean_query_heads" in json.dumps(heads)
    assert (folder / "heads" / "heads.html").is_file()


def test_without_the_import_the_missing_kind_is_named_with_the_way_to_provide_it(folder):
    done = _multihead(folder, "inspect", "to be or not", "--checkpoint", "run", "--out", "heads2")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "unknown attention kind 'mean_query_heads'" in done.stderr and "--import MODULE" in done.stderr
