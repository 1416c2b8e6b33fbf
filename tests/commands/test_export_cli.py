"""``multihead export --hf OUT`` from a run directory, MiniLM and a pruned sentence encoder, then
loaded by transformers / sentence-transformers and compared with the multihead model they came from
(different operations: float32 tolerances); mistakes are one line and write nothing."""

from __future__ import annotations

import json

import pytest
import torch
from support.cli import quietly
from support.paths import assert_paths_agree

transformers = pytest.importorskip("transformers")

from multihead.models import load_minilm  # noqa: E402
from multihead.models.checkpoint import load_checkpoint, save_checkpoint  # noqa: E402
from multihead.models.gpt import GPT, GPTConfig  # noqa: E402
from multihead.models.minilm import save_sentence_encoder  # noqa: E402
from multihead.tools.prune import prune_heads  # noqa: E402

SENTENCES = ["The cat sat on the mat.", "To be, or not to be, that is the question:", "a"]
LINES = ["To be, or not to be, that is the question:", "Whether 'tis nobler in the mind to suffer"] * 20


def refused(*argv: str) -> str:
    rc, out, err = quietly("export", *argv)
    assert rc == 2 and out == "" and "Traceback" not in err, err
    assert len(err.splitlines()) == 1 and err.startswith("multihead export: error: "), err
    return err.strip()


@pytest.fixture(scope="module")
def bpe_run(tmp_path_factory):
    """A two-step BPE training run directory."""
    from support.training import tiny_config

    from multihead.train.loop import train

    tmp = tmp_path_factory.mktemp("run")
    config = tiny_config(tmp, "\n".join(LINES) + "\n", tokenizer="bpe", vocab_size=300, max_steps=2,
                         eval_every=2, checkpoint_every=2, batch_size=4, warmup=1)  # fmt: skip
    train(config)
    return tmp / "run"


def test_a_bpe_run_exports_as_gpt2_with_its_tokenizer(bpe_run, tmp_path):
    out = tmp_path / "hf"
    rc, stdout, err = quietly("export", "--checkpoint", str(bpe_run), "--hf", str(out))
    assert rc == 0, err
    assert f"load it with transformers.GPT2LMHeadModel.from_pretrained('{out}')" in stdout
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json",
                                                     "tokenizer_config.json"]  # fmt: skip
    model = load_checkpoint(bpe_run).eval()  # a run directory: its latest checkpoint
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    tok = transformers.AutoTokenizer.from_pretrained(out)
    from multihead.train.tokenizer import load_tokenizer_dir

    text = LINES[1]
    ids = tok(text).input_ids
    assert ids == load_tokenizer_dir(bpe_run / "tokenizer").encode(text)
    idx = torch.tensor([ids])
    with torch.no_grad():
        assert_paths_agree(hf(idx).logits, model(idx))


def test_minilm_exports_as_bertmodel_and_sentence_transformers(tmp_path):
    sentence_transformers = pytest.importorskip("sentence_transformers")
    out = tmp_path / "minilm"
    rc, stdout, err = quietly("export", "--model", "minilm-l6", "--hf", str(out))
    assert rc == 0, err
    assert "add_pooling_layer=False" in stdout and "SentenceTransformer" in stdout
    model = load_minilm()
    st = sentence_transformers.SentenceTransformer(str(out), device="cpu")
    assert_paths_agree(st.encode(SENTENCES, convert_to_tensor=True), model.encode(SENTENCES))
    bert = transformers.BertModel.from_pretrained(out, add_pooling_layer=False, attn_implementation="eager").eval()
    batch = transformers.AutoTokenizer.from_pretrained(out)(SENTENCES, padding=True, return_tensors="pt")
    ours = model.tokenize(SENTENCES)
    assert torch.equal(batch["input_ids"], ours.input_ids)
    with torch.no_grad():
        want = bert(**batch).last_hidden_state
        got = model.encoder(ours.input_ids, ours.attention_mask, ours.token_type_ids)
    real = ours.attention_mask.bool()
    assert_paths_agree(got[real], want[real])


def test_a_pruned_minilm_needs_zero_heads_then_keeps_its_outputs(tmp_path):
    pruned = prune_heads(load_minilm(), {0: [1, 2], 3: [0, 5, 7], 5: [11]}).eval()
    folder = save_sentence_encoder(pruned, tmp_path / "pruned")
    out = tmp_path / "hf"
    line = refused("--checkpoint", str(folder), "--hf", str(out))
    assert "one head count for every layer" in line and "[10, 12, 12, 9, 12, 11] of 12 heads" in line
    assert "--zero-heads" in line and not out.exists()
    rc, stdout, err = quietly("export", "--checkpoint", str(folder), "--hf", str(out), "--zero-heads")
    assert rc == 0 and "zero heads" in stdout, err
    assert json.loads((out / "config.json").read_text())["num_attention_heads"] == 12
    bert = transformers.BertModel.from_pretrained(out, add_pooling_layer=False, attn_implementation="eager").eval()
    ours = pruned.tokenize(SENTENCES)
    with torch.no_grad():
        want = bert(input_ids=ours.input_ids, attention_mask=ours.attention_mask).last_hidden_state
        got = pruned.encoder(ours.input_ids, ours.attention_mask)
    real = ours.attention_mask.bool()
    assert_paths_agree(got[real], want[real])


def test_mistakes_are_one_line_and_write_nothing(tmp_path):
    torch.manual_seed(0)
    gqa = tmp_path / "gqa"
    save_checkpoint(GPT(GPTConfig.from_preset("tiny", attention="gqa", num_kv_heads=2)), gqa)
    plain = tmp_path / "plain"
    save_checkpoint(GPT(GPTConfig.from_preset("tiny")), plain)
    out = tmp_path / "out"
    line = refused("--checkpoint", str(gqa), "--hf", str(out))
    assert "GPT2LMHeadModel has plain multi-head attention" in line and "'gqa' with 2 key/value heads" in line
    assert "exactly one of --model and --checkpoint" in refused("--hf", str(out))
    assert "exactly one of --model and --checkpoint" in refused("--model", "minilm-l6", "--checkpoint", str(plain),
                                                                 "--hf", str(out))  # fmt: skip
    assert "--model bert: unknown model; valid: minilm-l6" in refused("--model", "bert", "--hf", str(out))
    assert "--zero-heads is for a pruned model" in refused("--checkpoint", str(plain), "--hf", str(out), "--zero-heads")
    assert f"--tokenizer {tmp_path / 'none.json'}: no such file" in refused(
        "--checkpoint", str(plain), "--hf", str(out), "--tokenizer", str(tmp_path / "none.json"))
    from multihead.models.minilm import minilm_model_dir

    wordpiece = str(minilm_model_dir() / "tokenizer.json")
    assert "the tokenizer has 30522 tokens, more than the model's vocab_size 256" in refused(
        "--checkpoint", str(plain), "--hf", str(out), "--tokenizer", wordpiece)
    (tmp_path / "file").write_text("x")
    assert "exists and is not a folder" in refused("--checkpoint", str(plain), "--hf", str(tmp_path / "file"))
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "gqa", "plain"]
