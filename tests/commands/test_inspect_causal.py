"""``multihead inspect`` on causal models: the causal roles lead the printout, heads.json and the page.

The checkpoint has a previous-token head set by hand (layer 0 head 0: its
query reads position i's one-hot embedding, its key position i - 1's, so
after LayerNorm the match outscores every other key by about 16 in the
softmax, a weight of ~1 on the previous token); the other heads keep their
random initial weights. A ``multihead train`` run directory and a Hugging
Face GPT-2 folder are scored as the library scores the same loaded models;
an encoder (a BERT folder) gets no causal section.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from support.cli import quietly

from multihead.models.checkpoint import load_checkpoint, save_checkpoint
from multihead.models.gpt import GPT, GPTConfig
from multihead.tools import capture, causal_head_scores, special_token_ids
from multihead.tools.visualize import write_html

pytest.importorskip("matplotlib")

CONTEXT = 16
PROMPT = "to be or not"


def previous_token_gpt() -> GPT:
    torch.manual_seed(0)
    model = GPT(GPTConfig.from_preset("tiny", context_length=CONTEXT)).eval()
    H, D = model.config.num_heads, model.config.head_dim
    with torch.no_grad():
        model.position_embedding.weight.zero_()
        model.position_embedding.weight[:, :CONTEXT] = torch.eye(CONTEXT)  # position p: one-hot in channel p
        W, b = model.blocks[0].attn.qkv_proj.weight, model.blocks[0].attn.qkv_proj.bias  # rows [q | k | v]
        W[:D], b[:D], W[H * D : H * D + D], b[H * D : H * D + D] = 0, 0, 0, 0
        for d in range(CONTEXT - 1):
            W[d, d + 1] = 1.0  # head 0's query: channel i of position i ...
            W[H * D + d, d] = 1.0  # ... meets the key of position i - 1
    return model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("ckpt") / "prev"
    save_checkpoint(previous_token_gpt(), folder)
    return folder


def inspected(*argv: str) -> tuple[str, dict, str]:
    out = Path(argv[argv.index("--out") + 1])
    rc, stdout, err = quietly("inspect", *argv)
    assert rc == 0, err
    return stdout, json.loads((out / "heads.json").read_text()), (out / "heads.html").read_text()


def page_data(page: str) -> dict:
    return json.loads(re.search(r'id="mh-data">(.*?)</script>', page, re.S).group(1))


def test_the_printout_and_the_files_lead_with_the_causal_roles(checkpoint, tmp_path):
    stdout, data, page = inspected(PROMPT, "--checkpoint", str(checkpoint), "--out", str(tmp_path / "o"))
    blocks = stdout.split("\n\n")
    causal = blocks[1].splitlines()
    assert causal[0].startswith("causal roles (8 sequences of 8 random tokens, each repeated")
    assert [line.split()[0] for line in causal[1:]] == ["induction", "previous_token", "duplicate_token", "copying"]
    assert causal[2].split()[1:] == [">=", "0.40", "1", "head", "L0", "H0", "1.00"]
    assert blocks[2].startswith("roles: ")  # then the roles on the text
    model = load_checkpoint(checkpoint).eval()
    want = causal_head_scores(model, vocab_size=256, length=CONTEXT // 2, batch=8)
    assert float(want.scores["previous_token"][0, 0]) > 0.99  # the head built for it
    assert [r["name"] for r in data["causal"]["roles"]] == ["induction", "previous_token", "duplicate_token", "copying"]
    for role, table in want.scores.items():
        torch.testing.assert_close(torch.tensor(data["causal"]["scores"][role]), table, rtol=0, atol=1e-6)
    assert page_data(page)["causal"] == data["causal"]


def test_verbose_lists_every_heads_causal_scores_before_the_role_table(checkpoint, tmp_path):
    stdout, data, _ = inspected(PROMPT, "--checkpoint", str(checkpoint), "--verbose", "--out", str(tmp_path / "o"))
    blocks = stdout.split("\n\n")
    assert blocks[1].startswith("causal roles")
    rows = blocks[2].splitlines()
    assert rows[0].split() == ["layer", "head", "induction", "previous_token", "duplicate_token", "copying"]
    assert [tuple(map(int, r.split()[:2])) for r in rows[1:9]] == [(i, j) for i in range(2) for j in range(4)]
    assert [float(v) for v in rows[1].split()[2:]] == pytest.approx(
        [data["causal"]["scores"][r][0][0] for r in ("induction", "previous_token", "duplicate_token", "copying")],
        abs=6e-4,
    )
    assert blocks[3].splitlines()[0].split()[:3] == ["layer", "head", "roles"]


def test_a_context_too_short_for_a_repeat_gets_a_notice_and_no_causal_roles(tmp_path):
    torch.manual_seed(0)
    save_checkpoint(GPT(GPTConfig.from_preset("tiny", context_length=3)), tmp_path / "short")
    stdout, data, _ = inspected("ab", "--checkpoint", str(tmp_path / "short"), "--out", str(tmp_path / "o"))
    note = "notice: no causal roles: the context of 3 tokens cannot hold a sequence of 2 tokens and its repeat"
    assert note in stdout.splitlines() and "causal roles (" not in stdout and "causal" not in data


def test_a_training_run_directory(tmp_path):
    """A run's scores draw from, and read the copying circuit over, the bytes its training text holds."""
    line = "to be or not to be that is the question\n"
    (tmp_path / "text.txt").write_text(line * 100)
    flags = ["--preset", "tiny", "--context-length", "32", "--batch-size", "4", "--eval-batches", "1",
             "--threads", "1", "--max-steps", "2", "--eval-every", "2", "--checkpoint-every", "2"]  # fmt: skip
    rc, _, err = quietly("train", "--data", str(tmp_path / "text.txt"), *flags, "--out", str(tmp_path / "run"))
    assert rc == 0, err
    stdout, data, _ = inspected(PROMPT, "--checkpoint", str(tmp_path / "run"), "--out", str(tmp_path / "o"))
    assert stdout.split("\n\n")[1].startswith("causal roles (8 sequences of 16 random tokens")
    model = load_checkpoint(next((tmp_path / "run" / "checkpoints").glob("step-*"))).eval()
    unseen = sorted(set(range(256)) - set(line.encode()))
    want = causal_head_scores(model, vocab_size=256, length=16, batch=8, exclude=unseen)
    every_byte = causal_head_scores(model, vocab_size=256, length=16, batch=8)
    assert not torch.allclose(want.scores["copying"], every_byte.scores["copying"])
    for role, table in want.scores.items():
        torch.testing.assert_close(torch.tensor(data["causal"]["scores"][role]), table, rtol=0, atol=1e-6)


CHROMIUM = Path("/usr/bin/chromium")
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking"]
ROLE_ORDER = "Array.from(document.querySelectorAll('#causal-roles li'), li => li.dataset.role)"


@pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's chromium: apt-get install -y chromium")
def test_the_page_shows_the_causal_roles_first_and_opens_their_heads(checkpoint, tmp_path):
    sync_playwright = pytest.importorskip("playwright.sync_api").sync_playwright
    inspected(PROMPT, "--checkpoint", str(checkpoint), "--out", str(tmp_path / "gpt"))
    encoder = write_html(encoder_record(), tmp_path / "encoder.html", roles=[])
    problems = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=ARGS)
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        page.on("console", lambda m: m.type in ("error", "warning") and problems.append(m.text))
        page.on("pageerror", lambda e: problems.append(str(e)))
        page.goto((tmp_path / "gpt" / "heads.html").as_uri())
        page.wait_for_selector("body[data-ready='true']", timeout=5000)
        assert page.is_visible("#causal")
        shown = page.evaluate("Array.from(document.querySelectorAll('main > section'), s => s.hidden ? null : s.id)")
        assert [s for s in shown if s][:2] == ["causal", "head-view"]
        assert page.locator("#causal").bounding_box()["y"] < page.locator("#head-view").bounding_box()["y"]
        assert page.evaluate(ROLE_ORDER) == ["induction", "previous_token", "duplicate_token", "copying"]
        previous = page.locator("#causal-roles li[data-role='previous_token']")
        assert "\u2265 0.40" in previous.inner_text() and "1 head" in previous.inner_text()
        data = json.loads((tmp_path / "gpt" / "heads.json").read_text())["causal"]["scores"]["induction"]
        best = max((v, i, j) for i, row in enumerate(data) for j, v in enumerate(row))
        closest = f"closest: L{best[1]} H{best[2]} {best[0]:.2f}"
        assert closest in page.locator("#causal-roles li[data-role='induction']").inner_text()
        page.locator(".mv-cell").nth(6).click()  # layer 1 head 2 in the model view
        hv = page.locator("#head-view")
        assert (hv.get_attribute("data-layer"), hv.get_attribute("data-head")) == ("1", "2")
        previous.locator("button.causal-head", has_text="L0 H0 1.00").click()
        assert (hv.get_attribute("data-layer"), hv.get_attribute("data-head")) == ("0", "0")
        page.click(".causal-all summary")
        rows = page.locator("#causal-table tbody tr")
        assert rows.count() == 8
        rows.nth(7).click()
        assert (hv.get_attribute("data-layer"), hv.get_attribute("data-head")) == ("1", "3")
        assert rows.nth(0).locator("td.hit").count() == 1  # L0 H0: previous_token only
        inspected(PROMPT, "--checkpoint", str(checkpoint), "--layer", "1", "--out", str(tmp_path / "one"))
        page.goto((tmp_path / "one" / "heads.html").as_uri())  # layer 0's weights on the text were not captured
        page.wait_for_selector("body[data-ready='true']", timeout=5000)
        assert page.locator("button.causal-head", has_text="L0 H0 1.00").is_disabled()
        page.goto(encoder.as_uri())
        page.wait_for_selector("body[data-ready='true']", timeout=5000)
        assert page.is_hidden("#causal") and page.evaluate(ROLE_ORDER) == []
        browser.close()
    assert problems == []


def encoder_record():
    """Weights of an encoder (every key visible): a page without causal scores."""
    from multihead import MultiHeadAttention

    torch.manual_seed(0)
    layer = MultiHeadAttention(8, 2).eval()
    with torch.no_grad(), capture(torch.nn.Sequential(layer)) as record:
        layer(torch.randn(1, 4, 8))
    record.query_tokens = ["a", "b", "c", "d"]
    return record


transformers = pytest.importorskip("transformers")


def hf_folder(folder: Path, kind: str) -> Path:
    """A random tiny GPT-2 or BERT with a word-level tokenizer.json whose ids 0 and 1 are special."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    words = ["<unk>", "<eos>", *"to be or not that is the question".split()]
    tok = Tokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = Whitespace()
    tok.add_special_tokens(["<unk>", "<eos>"])
    torch.manual_seed(0)
    if kind == "gpt2":
        config = transformers.GPT2Config(vocab_size=len(words), n_embd=24, n_layer=2, n_head=4, n_positions=32,
                                         bos_token_id=1, eos_token_id=1)  # fmt: skip
        transformers.GPT2LMHeadModel(config).save_pretrained(folder)
    else:
        config = transformers.BertConfig(vocab_size=len(words), hidden_size=24, num_hidden_layers=2,
                                         num_attention_heads=4, intermediate_size=40, max_position_embeddings=32)  # fmt: skip
        transformers.BertModel(config).save_pretrained(folder)
    tok.save(str(folder / "tokenizer.json"))
    return folder


def test_a_hugging_face_gpt2_gets_causal_roles_without_its_special_ids(tmp_path):
    import multihead.hf

    folder = hf_folder(tmp_path / "gpt2", "gpt2")
    stdout, data, _ = inspected(PROMPT, "--hf", str(folder), "--out", str(tmp_path / "o"))
    assert stdout.split("\n\n")[1].startswith("causal roles (8 sequences of 16 random tokens")
    from tokenizers import Tokenizer

    special = special_token_ids(Tokenizer.from_file(str(folder / "tokenizer.json")))
    assert special == [0, 1]
    model = multihead.hf.load_hf(folder)
    want = causal_head_scores(model, vocab_size=10, length=16, batch=8, exclude=special)
    assert (
        set(data["causal"]["scores"])
        == set(want.scores)
        == {"induction", "previous_token", "duplicate_token", "copying"}
    )
    for role, table in want.scores.items():
        torch.testing.assert_close(torch.tensor(data["causal"]["scores"][role]), table, rtol=0, atol=1e-6)
    other = causal_head_scores(model, vocab_size=10, length=16, batch=8)  # 0 and 1 drawn too: other scores
    assert not torch.allclose(other.scores["copying"], want.scores["copying"])


def test_an_encoder_has_no_causal_section(tmp_path):
    folder = hf_folder(tmp_path / "bert", "bert")
    stdout, data, page = inspected(PROMPT, "--hf", str(folder), "--out", str(tmp_path / "o"))
    assert "causal roles" not in stdout and "causal" not in data and "causal" not in page_data(page)
    assert stdout.split("\n\n")[1].startswith("roles: ")
