"""The Activations record: reading by name and by layer, moving, saving and loading back."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from multihead.models.gpt import GPT, GPTConfig
from multihead.tools import Activations, run_with_cache


@pytest.fixture(scope="module")
def acts() -> Activations:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=30, context_length=8, embed_dim=16, num_layers=2, num_heads=4, num_kv_heads=2,
                          attention="gqa")).eval()  # fmt: skip
    _, record = run_with_cache(model, torch.randint(0, 30, (2, 5)), names=["q", "k", "pattern"], heads=[1, 2])
    return record


def test_names_layers_and_attribute_reads(acts):
    assert acts.names == ("q", "k", "pattern") and acts.layers == (0, 1) and acts.heads == (1, 2)
    assert acts.source == "GPT" and len(acts) == 6 and "layers.1.k" in acts
    one = acts.layer(1)
    assert one.q is acts["layers.1.q"] and one.kv_heads == (0, 1) and one.heads == (1, 2)
    with pytest.raises(AttributeError, match=r"layer 1 holds no 'z': it holds \['q', 'k', 'pattern'\]"):
        _ = one.z
    with pytest.raises(AttributeError, match="valid names"):
        _ = one.hook_q
    with pytest.raises(KeyError, match=r"layer 2 was not recorded: this record holds layers \[0, 1\]"):
        acts.layer(2)
    with pytest.raises(KeyError, match=r"holds layers.\{i\}.\{name\} for layers \[0, 1\] and names \['q', 'k', 'pattern'\]"):
        acts["layers.0.z"]


def test_to_and_detach_make_new_records(acts):
    wide = acts.to(dtype=torch.float64)
    assert all(t.dtype == torch.float64 for t in wide.tensors.values())
    assert all(t.dtype == torch.float32 for t in acts.tensors.values())  # the original is unchanged
    torch.testing.assert_close(wide["layers.0.q"].float(), acts["layers.0.q"], rtol=0, atol=0)
    assert wide.kv_heads == acts.kv_heads and wide.names == acts.names
    grad = Activations({"layers.0.q": torch.ones(2, requires_grad=True) * 2}, ("q",), (0,))
    assert grad["layers.0.q"].requires_grad and not grad.detach()["layers.0.q"].requires_grad


def test_save_and_load_back(acts, tmp_path):
    path = tmp_path / "acts.safetensors"
    path.write_bytes(b"an older file")
    assert acts.save(path) == path
    assert sorted(p.name for p in tmp_path.iterdir()) == ["acts.safetensors"]  # replaced whole, no temp left
    back = Activations.load(path)
    assert back.keys() == acts.keys()
    for key in acts.keys():
        torch.testing.assert_close(back[key], acts[key], rtol=0, atol=0)
    assert (back.names, back.layers, back.heads, back.kv_heads, back.source) == (
        acts.names, acts.layers, acts.heads, acts.kv_heads, acts.source
    )  # fmt: skip


def test_load_refuses_other_files(tmp_path):
    plain = tmp_path / "plain.safetensors"
    save_file({"x": torch.zeros(2)}, str(plain))
    with pytest.raises(ValueError, match="holds no multihead.activations metadata"):
        Activations.load(plain)
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not a safetensors file at all")
    with pytest.raises(ValueError, match="is not a readable safetensors file"):
        Activations.load(junk)
    odd = tmp_path / "odd.safetensors"
    save_file({"x": torch.zeros(2)}, str(odd), metadata={"multihead.activations": json.dumps({"names": ["nope"]})})
    with pytest.raises(ValueError, match="metadata is not a record description") as err:
        Activations.load(odd)
    assert "\n" not in str(err.value)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_record_stays_on_the_device_and_saves_from_it(tmp_path):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=30, context_length=8, embed_dim=16, num_layers=2, num_heads=4, num_kv_heads=2,
                          attention="gqa"), device="cuda").eval()  # fmt: skip
    ids = torch.randint(0, 30, (2, 5), device="cuda")
    _, acts = run_with_cache(model, ids, names=["q", "pattern", "z"], heads=[1])
    assert all(t.device.type == "cuda" for t in acts.tensors.values())
    cpu_model = GPT(model.config).eval()
    cpu_model.load_state_dict({k: v.cpu() for k, v in model.state_dict().items()})
    _, on_cpu = run_with_cache(cpu_model, ids.cpu(), names=["q", "pattern", "z"], heads=[1])
    for key in acts.keys():
        torch.testing.assert_close(acts.to("cpu")[key], on_cpu[key], rtol=1e-4, atol=1e-5)
    back = Activations.load(acts.save(tmp_path / "acts.safetensors"))
    assert all(t.device.type == "cpu" for t in back.tensors.values()) and back.keys() == acts.keys()
