"""The HTML, PNG and JSON views of captured attention (no browser needed)."""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import re
import struct
import sys

import pytest
import torch
from torch import nn

from multihead import MultiHeadAttention
from multihead.tools import AttentionRecord, LayerAttention, capture
from multihead.tools.visualize import write_html, write_json, write_png

TOKENS = ["<s>", "<script>alert(1)</script>", '"quoted"', "</script>", "a & b", "<!--", "x\u2028y", "end"]
ROLES = [
    {"layer": 0, "head": 1, "labels": ["previous"], "scores": {"previous": 0.93, "broad": 0.2}},
    {"layer": 1, "head": 2, "labels": ["broad", "<i>odd</i>"], "scores": {"broad": 0.9, "cls": float("nan")}},
]


class Stack(nn.Module):
    """Two causal self-attention layers of three heads."""

    def __init__(self, num_heads=(3, 3)):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([MultiHeadAttention(12, h) for h in num_heads])

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x, is_causal=True)
        return x


def captured(tokens=TOKENS, num_heads=(3, 3), batch=1) -> AttentionRecord:
    model = Stack(num_heads).eval()
    with torch.no_grad(), capture(model) as record:
        model(torch.randn(batch, len(tokens), 12) * 3)
    record.query_tokens = list(tokens)
    return record


def synthetic(shapes, layers=None) -> AttentionRecord:
    """A record with softmax weights of the given [B, H, T, S] shapes."""
    g = torch.Generator().manual_seed(1)
    out = [
        LayerAttention(layer=i if layers is None else layers[i], name=f"l{i}", kind="mha",
                       weights=torch.randn(shape, generator=g).softmax(-1))
        for i, shape in enumerate(shapes)
    ]
    return AttentionRecord(out)


def embedded(page: str) -> dict:
    found = re.search(r'<script type="application/json" id="mh-data">(.*?)</script>', page, re.S)
    return json.loads(found.group(1))


def test_html_is_one_self_contained_file(tmp_path):
    path = write_html(captured(), tmp_path / "heads.html", roles=ROLES)
    assert path == tmp_path / "heads.html" and sorted(p.name for p in tmp_path.iterdir()) == ["heads.html"]
    page = path.read_text(encoding="utf-8")
    for network in ("http://", "https://", "//cdn", "@import", "url(", " src=", "<link rel=\"stylesheet\""):
        assert network not in page, network
    assert page.count("<script") == 2 and page.count("</script") == 2  # the data block and the viewer
    assert page.count("<style>") == 1
    csp = re.search(r'http-equiv="Content-Security-Policy" content="([^"]*)"', page).group(1)
    assert "default-src 'none'" in csp and "unsafe" not in csp


def test_csp_hashes_allow_exactly_the_inline_script_and_style(tmp_path):
    page = write_html(captured(), tmp_path / "heads.html").read_text(encoding="utf-8")

    def digest(text):
        return "sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode()

    script = re.search(r"<script>(.*?)</script>", page, re.S).group(1)
    style = re.search(r"<style>(.*?)</style>", page, re.S).group(1)
    assert f"script-src '{digest(script)}'" in page and f"style-src '{digest(style)}'" in page


def test_tokens_and_title_cannot_break_out_of_the_page(tmp_path):
    page = write_html(captured(), tmp_path / "heads.html", roles=ROLES, title='demo <b>"x"</b>').read_text("utf-8")
    data_block = re.search(r'id="mh-data">(.*?)</script>', page, re.S).group(1)
    for raw in ("</", "<!--", "<script", "\u2028", "\u2029", "<i>", "&"):
        assert raw not in data_block, raw
    assert "\\u003c/script\\u003e" in data_block and "\\u2028" in data_block
    assert "alert(1)" not in page.replace(data_block, "")  # tokens live only in the data block
    assert "<title>demo &lt;b&gt;&quot;x&quot;&lt;/b&gt;</title>" in page
    data = embedded(page)
    assert data["query_tokens"] == TOKENS == data["key_tokens"]
    assert data["title"] == 'demo <b>"x"</b>'
    assert data["roles"][1]["labels"] == ["broad", "<i>odd</i>"]


def test_html_embeds_weights_and_roles_by_row(tmp_path):
    record = captured()
    data = embedded(write_html(record, tmp_path / "h.html", roles=ROLES, batch=0).read_text("utf-8"))
    assert data["source"] == "Stack" and data["title"] == "Stack attention"
    assert [(L["layer"], L["name"], L["kind"]) for L in data["layers"]] == [(0, "blocks.0", "mha"), (1, "blocks.1", "mha")]
    for entry, L in zip(record.layers, data["layers"]):
        torch.testing.assert_close(torch.tensor(L["weights"], dtype=torch.float64), entry.weights[0].double(), atol=5e-5, rtol=0)
    assert [(r["row"], r["head"], r["labels"]) for r in data["roles"]] == [(0, 1, ["previous"]), (1, 2, ["broad", "<i>odd</i>"])]
    assert data["roles"][1]["scores"] == {"broad": 0.9, "cls": None}  # NaN is not JSON
    assert embedded(write_html(record, tmp_path / "n.html").read_text("utf-8"))["roles"] is None


def test_roles_accept_objects_and_follow_repeated_calls(tmp_path):
    @dataclasses.dataclass
    class HeadRoles:  # the shape of multihead.tools.roles.HeadRoles
        layer: int
        head: int
        scores: dict
        labels: list
        entropy: float | None = None
        mean_distance: float | None = None

    record = synthetic([(1, 2, 3, 3)] * 3, layers=[0, 0, 1])  # module 0 called twice, then module 1
    roles = [HeadRoles(0, 1, {"self": 1.0}, ["self"], entropy=0.5), HeadRoles(0, 1, {}, []), HeadRoles(1, 0, {}, [])]
    data = embedded(write_html(record, tmp_path / "h.html", roles=roles).read_text("utf-8"))
    assert [(r["row"], r["layer"], r["head"]) for r in data["roles"]] == [(0, 0, 1), (1, 0, 1), (2, 1, 0)]
    assert data["roles"][0]["scores"] == {"self": 1.0, "entropy": 0.5}
    with pytest.raises(ValueError, match="repeats layer=0, head=1: the record has 2 call"):
        write_html(record, tmp_path / "h.html", roles=roles + [HeadRoles(0, 1, {}, [])])


def test_png_is_a_grid_of_plausible_size(tmp_path):
    path = write_png(captured(), tmp_path / "heads.png", roles=ROLES)
    blob = path.read_bytes()
    assert blob[:8] == b"\x89PNG\r\n\x1a\n" and blob[12:16] == b"IHDR"
    width, height = struct.unpack(">II", blob[16:24])
    assert 500 <= width <= 4000 and 400 <= height <= 4000, (width, height)
    assert 10_000 < len(blob) < 2_000_000
    assert sorted(p.name for p in tmp_path.iterdir()) == ["heads.png"]  # no temporary file left


def test_png_handles_long_inputs_and_max_tokens(tmp_path):
    record = synthetic([(1, 4, 60, 60), (1, 2, 60, 60)])  # no tokens, too many for labels, uneven heads
    record.query_tokens = [f"${i}$" for i in range(60)]  # "$" would start matplotlib math mode
    assert write_png(record, tmp_path / "a.png").stat().st_size > 5_000
    assert write_png(record, tmp_path / "b.png", max_tokens=12).stat().st_size > 5_000
    with pytest.raises(ValueError, match="max_tokens must be a positive int, got max_tokens=0"):
        write_png(record, tmp_path / "c.png", max_tokens=0)


def test_png_without_matplotlib_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match=re.escape("pip install 'multihead[viz]'")):
        write_png(captured(), tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()


def test_json_round_trips_with_roles(tmp_path):
    record = captured(batch=2)
    path = write_json(record, tmp_path / "heads.json", roles=ROLES, batch=1)
    data = json.loads(path.read_text(encoding="utf-8"))
    assert data["query_tokens"] == TOKENS
    assert data["roles"][0] == {"layer": 0, "head": 1, "labels": ["previous"], "scores": {"previous": 0.93, "broad": 0.2}}
    assert data["roles"][1]["scores"]["cls"] is None
    back = AttentionRecord.from_dict(data)
    assert back.query_tokens == TOKENS and len(back.layers) == 2
    for a, b in zip(back.layers, record.layers):
        torch.testing.assert_close(a.weights[0], b.weights[1], atol=1e-6, rtol=0)
    assert json.loads(write_json(record, tmp_path / "n.json").read_text())["roles"] is None


def test_writes_replace_atomically_and_clean_up_on_failure(tmp_path, monkeypatch):
    path = tmp_path / "heads.html"
    path.write_text("old")
    write_html(captured(), path)
    assert path.read_text("utf-8").startswith("<!DOCTYPE html>")

    def broken(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr("multihead.tools.visualize.os.replace", broken)
    with pytest.raises(OSError, match="disk full"):
        write_json(captured(), path)
    assert path.read_text("utf-8").startswith("<!DOCTYPE html>")
    assert [p.name for p in tmp_path.iterdir()] == ["heads.html"]


@pytest.mark.parametrize("write", [write_html, write_png, write_json])
def test_bad_records_are_refused_with_the_numbers(tmp_path, write):
    out = tmp_path / "out"
    with pytest.raises(ValueError, match="empty"):
        write(AttentionRecord(), out)
    record = captured(tokens=TOKENS[:5])
    record.query_tokens = TOKENS[:4]
    with pytest.raises(ValueError, match="query_tokens has 4 tokens but the weights have T=5"):
        write(record, out)
    record.query_tokens, record.key_tokens = TOKENS[:5], TOKENS[:6]
    with pytest.raises(ValueError, match="key_tokens has 6 tokens but the weights have S=5"):
        write(record, out)
    record.key_tokens = None
    with pytest.raises(ValueError, match=r"batch=1 out of range for layer 0 with B=1"):
        write(record, out, batch=1)
    with pytest.raises(ValueError, match=r"layer 1 \(l1\) has T=2, S=4 but layer 0 has T=3, S=4"):
        write(synthetic([(1, 2, 3, 4), (1, 2, 2, 4)]), out)
    with pytest.raises(TypeError, match="record must be an AttentionRecord, got dict"):
        write({"layers": []}, out)
    record.query_tokens = ["a", "b", 3, "d", "e"]
    with pytest.raises(TypeError, match=r"query_tokens\[2\] must be a str, got 3 \(int\)"):
        write(record, out)
    assert not out.exists()


@pytest.mark.parametrize(
    "roles, error, message",
    [
        ({"layer": 0, "head": 0}, TypeError, "roles must be a list"),
        ([{"layer": 5, "head": 0}], ValueError, r"roles\[0\] has layer=5, but the record's layers are \[0, 1\]"),
        ([{"layer": 1, "head": 3}], ValueError, r"roles\[0\] has head=3, but layer 1 has 3 heads"),
        ([{"head": 0}], TypeError, r"roles\[0\] needs 'layer' and 'head'"),
        ([{"layer": 0, "head": 0, "labels": [1]}], TypeError, r"roles\[0\]\['labels'\] must be a list of str"),
        ([{"layer": 0, "head": 0, "scores": {"a": "high"}}], TypeError, r"roles\[0\]\['scores'\]\['a'\] must be a number"),
        ([{"layer": -1, "head": 0}], ValueError, r"roles\[0\]\['layer'\] must be a non-negative int"),
    ],
)
def test_bad_roles_are_refused(tmp_path, roles, error, message):
    with pytest.raises(error, match=message):
        write_html(captured(), tmp_path / "h.html", roles=roles)


def test_legend_and_notices_are_embedded_as_data(tmp_path):
    from multihead.tools.roles import ROLE_THRESHOLDS, SCORE_MEANINGS, role_legend

    legend = {name: {"meaning": meaning, "threshold": limit} for name, meaning, limit in role_legend()}
    legend["custom"] = "a score of our own"  # a plain string is the meaning
    notices = ["the text was cut <b>here</b>", "3 of 4 words became [UNK]"]
    page = write_html(captured(), tmp_path / "h.html", roles=ROLES, legend=legend, notices=notices).read_text("utf-8")
    data = embedded(page)
    assert data["notices"] == notices and "<b>here</b>" not in page  # only inside the escaped data block
    assert data["legend"]["previous"] == {"meaning": SCORE_MEANINGS["previous"], "threshold": ROLE_THRESHOLDS["previous"]}
    assert data["legend"]["entropy"]["threshold"] is None
    assert data["legend"]["custom"] == {"meaning": "a score of our own", "threshold": None}
    plain = embedded(write_html(captured(), tmp_path / "p.html").read_text("utf-8"))
    assert plain["legend"] is None and plain["notices"] == []


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"legend": ["previous"]}, "legend must be a dict of column -> meaning, got list"),
        ({"legend": {"previous": {"threshold": 0.9}}}, r"legend\['previous'\] must be a str or a dict with a str 'meaning'"),
        ({"legend": {"previous": {"meaning": "m", "threshold": "high"}}}, r"legend\['previous'\]\['threshold'\] must be a number"),
        ({"notices": "one notice"}, "notices must be a list of str, got str"),
        ({"notices": ["ok", 3]}, r"notices\[1\] must be a str, got 3"),
    ],
)
def test_bad_legend_or_notices_are_refused(tmp_path, kwargs, message):
    with pytest.raises(TypeError, match=message):
        write_html(captured(), tmp_path / "h.html", **kwargs)
    assert not (tmp_path / "h.html").exists()
