"""Checkpoints: one safetensors file (weights, config, checksums) + a JSON copy, round trips, clear errors."""

from __future__ import annotations

import hashlib
import json
import struct

import pytest
import torch

from multihead.models.checkpoint import checkpoint_paths, load_checkpoint, read_config, save_checkpoint
from multihead.models.gpt import GPT, GPTConfig


def model(seed=0, dtype=torch.float32, **overrides) -> GPT:
    torch.manual_seed(seed)
    cfg = GPTConfig.from_preset("tiny", **{"context_length": 32, "vocab_size": 61, **overrides})
    return GPT(cfg, dtype=dtype).eval()


def same_logits(a: GPT, b: GPT) -> bool:
    idx = torch.randint(0, a.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return torch.equal(a.eval()(idx), b.eval()(idx))


@pytest.mark.parametrize("layout", ["run", "tiny.safetensors"])
def test_round_trip_gives_identical_logits(tmp_path, layout):
    m = model()
    config_path, weights_path = save_checkpoint(m, tmp_path / layout)
    assert config_path.is_file() and weights_path.is_file()
    if layout == "run":
        assert (config_path.name, weights_path.name) == ("config.json", "model.safetensors")
    else:
        assert (config_path.name, weights_path.name) == ("tiny.json", "tiny.safetensors")
    loaded = load_checkpoint(tmp_path / layout)
    assert loaded.config == m.config
    assert loaded.lm_head.weight is loaded.token_embedding.weight
    assert same_logits(m, loaded)
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == sorted([config_path.name, weights_path.name])


@pytest.mark.parametrize(
    "overrides",
    [
        dict(attention="gqa", num_kv_heads=2),
        dict(attention="mqa"),
        dict(tie_embeddings=False, qkv_bias=False),
    ],
)
def test_round_trip_other_configs(tmp_path, overrides):
    m = model(seed=1, **overrides)
    save_checkpoint(m, tmp_path / "c")
    loaded = load_checkpoint(tmp_path / "c", config=m.config)
    assert loaded.config == m.config and same_logits(m, loaded)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_dtype_is_kept(tmp_path, dtype):
    m = model(dtype=dtype)
    save_checkpoint(m, tmp_path / "c")
    loaded = load_checkpoint(tmp_path / "c")
    assert loaded.token_embedding.weight.dtype == dtype and same_logits(m, loaded)


def test_files_are_json_and_safetensors_not_pickle(tmp_path):
    config_path, weights_path = save_checkpoint(model(), tmp_path / "c")
    data = json.loads(config_path.read_text())
    assert data["format"] == "multihead.gpt" and data["config"]["embed_dim"] == 64
    raw = weights_path.read_bytes()
    (header_len,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + header_len])
    assert "token_embedding.weight" in header and "lm_head.weight" not in header  # tied: stored once
    # the header carries the config and a sha256 of the config text and of each tensor's bytes
    meta = header["__metadata__"]
    assert json.loads(meta["config"]) == data["config"]
    sums = json.loads(meta["sha256"])
    assert sums["config"] == hashlib.sha256(meta["config"].encode()).hexdigest()
    assert set(sums["tensors"]) == set(header) - {"__metadata__"}
    for name, entry in header.items():
        if name != "__metadata__":
            start, end = (8 + header_len + o for o in entry["data_offsets"])
            assert sums["tensors"][name] == hashlib.sha256(raw[start:end]).hexdigest()
    assert not raw.startswith(b"\x80") and b"PK\x03\x04" not in raw[:4]
    assert read_config(tmp_path / "c") == model().config


def test_overwrite_replaces_the_files(tmp_path):
    save_checkpoint(model(seed=0), tmp_path / "c")
    second = model(seed=1)
    save_checkpoint(second, tmp_path / "c")
    assert same_logits(second, load_checkpoint(tmp_path / "c"))
    assert len(list((tmp_path / "c").iterdir())) == 2


def test_corrupt_weights_raise_value_error(tmp_path):
    _, weights_path = save_checkpoint(model(), tmp_path / "c")
    raw = weights_path.read_bytes()
    weights_path.write_bytes(raw[: len(raw) // 2])  # truncated
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        load_checkpoint(tmp_path / "c")
    weights_path.write_bytes(b"garbage, not a checkpoint")
    with pytest.raises(ValueError, match=r"model.safetensors is not a readable safetensors file"):
        load_checkpoint(tmp_path / "c")


def test_the_config_in_the_header_is_the_one_used(tmp_path):
    # config.json is a copy written after the weights: stale (a kill between the two
    # writes), edited or corrupt, it changes nothing; the weights' header decides.
    m = model()
    config_path, _ = save_checkpoint(m, tmp_path / "c")
    stale = json.dumps({"format": "multihead.gpt", "version": 1, "config": {}})
    for text in ["{not json", json.dumps({"hello": 1}), stale]:
        config_path.write_text(text)
        assert read_config(tmp_path / "c") == m.config
        assert same_logits(m, load_checkpoint(tmp_path / "c"))
    # another model's weights in the directory: that model, with its own config
    b_config, b_weights = save_checkpoint(model(seed=1, num_layers=3), tmp_path / "b")
    b_weights.replace(tmp_path / "c" / "model.safetensors")
    loaded = load_checkpoint(tmp_path / "c")
    assert loaded.config.num_layers == 3 and read_config(tmp_path / "c") == loaded.config
    assert same_logits(model(seed=1, num_layers=3), loaded)


def without_header_config(weights_path) -> None:
    """Rewrite the weights as another tool would: no config in the header."""
    from safetensors.torch import load_file, save_file

    save_file(load_file(str(weights_path)), str(weights_path))


def test_weights_without_a_header_config_use_the_json_file(tmp_path):
    m = model()
    config_path, weights_path = save_checkpoint(m, tmp_path / "c")
    without_header_config(weights_path)
    assert read_config(tmp_path / "c") == m.config and same_logits(m, load_checkpoint(tmp_path / "c"))
    config_path.write_text("{not json")
    with pytest.raises(ValueError, match="config.json is not valid JSON"):
        load_checkpoint(tmp_path / "c")
    config_path.write_text(json.dumps({"hello": 1}))
    with pytest.raises(ValueError, match="config.json is not a multihead GPT checkpoint config"):
        load_checkpoint(tmp_path / "c")
    config_path.write_text(json.dumps({"format": "multihead.gpt", "version": 7, "config": {}}))
    with pytest.raises(ValueError, match="config.json has checkpoint version 7; this reader knows 1"):
        read_config(tmp_path / "c")
    config_path.write_text(json.dumps({"format": "multihead.gpt", "version": 1, "config": {"vocab_size": 0}}))
    with pytest.raises(ValueError, match="config.json: invalid config"):
        load_checkpoint(tmp_path / "c")
    config_path.unlink()
    with pytest.raises(FileNotFoundError, match="no checkpoint config at .*config.json"):
        load_checkpoint(tmp_path / "c")


def test_config_that_does_not_match_the_weights(tmp_path):
    from safetensors.torch import load_file, save_file

    a_config, a_weights = save_checkpoint(model(), tmp_path / "a")
    _, b_weights = save_checkpoint(model(num_layers=3), tmp_path / "b")
    # weights without the header copy, paired with a JSON file of fewer layers
    tensors = load_file(str(b_weights))
    save_file(tensors, str(a_weights))
    with pytest.raises(ValueError, match=r"model.safetensors does not match its config: num_layers=2, the file holds"):
        load_checkpoint(tmp_path / "a")
    tensors = {k: v for k, v in tensors.items() if not k.startswith("blocks.2")}
    tensors["position_embedding.weight"] = torch.zeros(16, 64)
    save_file(tensors, str(a_weights))
    with pytest.raises(ValueError, match=r"wrong shape.*position_embedding.weight: \(16, 64\) in the file vs \(32,"):
        load_checkpoint(tmp_path / "a")
    tensors["position_embedding.weight"] = torch.zeros(32, 64)
    tensors["blocks.1.attn.out_proj.weight"] = torch.zeros(64, 63)
    save_file(tensors, str(a_weights))
    with pytest.raises(ValueError, match=r"blocks.1.attn.out_proj.weight: \(64, 63\) vs model \(64, 64\)"):
        load_checkpoint(tmp_path / "a")
    del tensors["blocks.1.attn.out_proj.weight"]
    save_file(tensors, str(a_weights))
    with pytest.raises(ValueError, match=r"does not match the model: missing \['blocks.1.attn.out_proj.weight'\]"):
        load_checkpoint(tmp_path / "a")


def test_files_of_the_previous_version_still_load(tmp_path):
    """The previous writer: the config in the header but no checksums, JSON beside."""
    from safetensors.torch import save_file

    for dtype in (torch.float32, torch.bfloat16):
        m = model(seed=2, dtype=dtype, tie_embeddings=False)
        for path in (tmp_path / f"dir_{dtype}", tmp_path / f"pair_{dtype}.safetensors"):
            config_path, weights_path = checkpoint_paths(path)
            config_path.parent.mkdir(exist_ok=True)
            config = m.config.to_dict()
            metadata = {"format": "multihead.gpt", "config": json.dumps(config, sort_keys=True)}
            save_file({k: v.contiguous() for k, v in m.state_dict().items()}, str(weights_path), metadata=metadata)
            config_path.write_text(json.dumps({"format": "multihead.gpt", "version": 1, "config": config}))
            loaded = load_checkpoint(path)
            assert loaded.config == m.config and loaded.token_embedding.weight.dtype == dtype
            assert all(torch.equal(v, loaded.state_dict()[k]) for k, v in m.state_dict().items())


def test_expected_config_mismatch(tmp_path):
    save_checkpoint(model(), tmp_path / "c")
    other = GPTConfig.from_preset("tiny", context_length=32, vocab_size=61, num_heads=2)
    with pytest.raises(ValueError, match=r"differs from the expected config.*'num_heads': \(4, 2\)"):
        load_checkpoint(tmp_path / "c", config=other)


def test_missing_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint config at .*nowhere.config.json and no weights"):
        load_checkpoint(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="no checkpoint config at .*nowhere.config.json"):
        read_config(tmp_path / "nowhere")
    config_path, weights_path = save_checkpoint(model(), tmp_path / "c")
    weights_path.unlink()
    with pytest.raises(FileNotFoundError, match="no checkpoint weights"):
        load_checkpoint(tmp_path / "c")
    assert checkpoint_paths(tmp_path / "x.json") == (tmp_path / "x.json", tmp_path / "x.safetensors")
    with pytest.raises(TypeError, match="takes a GPT"):
        save_checkpoint(torch.nn.Linear(2, 2), tmp_path / "d")
