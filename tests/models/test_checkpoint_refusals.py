"""Checkpoints that must not load: wrong dtypes, sizes that do not match the tensors,
hostile JSON, malformed headers, corrupted bytes. Each is one ValueError naming the
file, raised before the model is built (and, for sizes and dtypes, before any tensor is read)."""

from __future__ import annotations

import hashlib
import json
import re
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

from multihead.models import checkpoint
from multihead.models.checkpoint import load_checkpoint, read_config, save_checkpoint
from multihead.models.gpt import GPT, GPTConfig

DEEP = "[" * 100_000 + "]" * 100_000  # json.loads raises RecursionError on it


@pytest.fixture
def saved(tmp_path):
    """A saved checkpoint: (model, directory, config path, weights path)."""
    torch.manual_seed(0)
    m = GPT(GPTConfig.from_preset("tiny", vocab_size=61, context_length=32)).eval()
    config_path, weights_path = save_checkpoint(m, tmp_path / "c")
    return m, tmp_path / "c", config_path, weights_path


@pytest.fixture
def work(monkeypatch):
    """What loading did: GPTs built for real (not on the meta device) and tensor reads."""
    done = {"built": [], "read": []}

    class Spy(GPT):
        def __init__(self, config, *, device=None, dtype=None):
            if str(device) != "meta":
                done["built"].append(config)
            super().__init__(config, device=device, dtype=dtype)

    real_read = checkpoint.read_tensors

    def read(*args, **kwargs):
        done["read"].append(args[1].path)
        return real_read(*args, **kwargs)

    monkeypatch.setattr(checkpoint, "GPT", Spy)
    monkeypatch.setattr(checkpoint, "read_tensors", read)
    return done


def refused(path, match: str, names, call=load_checkpoint) -> str:
    """``call(path)`` raises one ValueError matching ``match`` whose message names ``names`` (the file)."""
    with pytest.raises(ValueError, match=match) as info:
        call(path)
    assert str(names) in str(info.value), str(info.value)
    return str(info.value)


def sha256_hex(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().reshape(-1).view(torch.uint8).numpy()).hexdigest()


def rewrite(weights_path, *, tensors=None, config_text=None, checksums=True) -> None:
    """Write the weights as save_checkpoint does, with the tensors and/or the config text
    replaced and, unless ``checksums`` is False, checksums that match the new contents."""
    old = json.loads(read_header(weights_path)[1]["__metadata__"]["config"])
    tensors = load_file(str(weights_path)) if tensors is None else tensors
    config_text = json.dumps(old, sort_keys=True) if config_text is None else config_text
    metadata = {"format": "multihead.gpt", "config": config_text}
    if checksums:
        sums = {
            "config": hashlib.sha256(config_text.encode()).hexdigest(),
            "tensors": {k: sha256_hex(v) for k, v in tensors.items()},
        }
        metadata["sha256"] = json.dumps(sums)
    save_file(tensors, str(weights_path), metadata=metadata)


def with_config(weights_path, **changes) -> None:
    config = json.loads(read_header(weights_path)[1]["__metadata__"]["config"])
    rewrite(weights_path, config_text=json.dumps({**config, **changes}, sort_keys=True))


def read_header(weights_path) -> tuple[int, dict, bytes]:
    raw = weights_path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return n, json.loads(raw[8 : 8 + n]), raw


def write_raw(weights_path, header: dict | bytes, data: bytes) -> None:
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    weights_path.write_bytes(struct.pack("<Q", len(text)) + text + data)


# ------------------------------------------------------------------ dtypes
@pytest.mark.parametrize(
    ("dtype", "name"),
    [(torch.int64, "I64"), (torch.int32, "I32"), (torch.int8, "I8"), (torch.uint8, "U8"), (torch.bool, "BOOL")],
)
def test_integer_or_bool_weights_are_refused(saved, work, dtype, name):
    _, path, _, weights_path = saved
    tensors = load_file(str(weights_path))
    tensors["ln_f.weight"] = tensors["ln_f.weight"].to(dtype)  # ones: 1 / True
    rewrite(weights_path, tensors=tensors)
    match = rf"non-floating-point tensors where floating-point weights .* belong: \['ln_f.weight \({name}\)'\]"
    refused(path, match, weights_path)
    assert work == {"built": [], "read": []}


# ------------------------------------------------------------------ sizes
@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"context_length": 2**40}, r"position_embedding.weight: \(32, 64\) in the file vs \(1099511627776, 64\)"),
        ({"vocab_size": 2**40}, r"token_embedding.weight: \(61, 64\) in the file vs \(1099511627776, 64\)"),
        (
            {"embed_dim": 2**30, "num_heads": 2**20},
            r"token_embedding.weight: \(61, 64\) in the file vs \(61, 1073741824\)",
        ),
        ({"num_layers": 10**9}, r"does not match its config: num_layers=1000000000, the file holds blocks \[0, 1\]"),
        ({"num_layers": 1}, r"num_layers=1, the file holds blocks \[0, 1\] \(2 in all\)"),
        ({"attention": "mqa"}, r"tensors of the wrong shape for the model config: blocks.0.attn.qkv_proj.weight: "),
        ({"qkv_bias": False}, r"does not match the model: missing \[\], unexpected \['blocks.0.attn.qkv_proj.bias'"),
        ({"tie_embeddings": False}, r"does not match the model: missing \['lm_head.weight'\], unexpected \[\]"),
    ],
)
def test_config_sizes_that_do_not_match_the_tensors_are_refused_before_allocating(saved, work, changes, match):
    # A config claiming 2**40 positions or 10**9 layers never gets a model (or a tensor read) for it:
    # shapes come from the file's header and from a GPT built on the meta device.
    _, path, _, weights_path = saved
    with_config(weights_path, **changes)
    refused(path, match, weights_path)
    assert work == {"built": [], "read": []}
    assert read_config(path) == GPTConfig.from_preset("tiny", **{"vocab_size": 61, "context_length": 32, **changes})


# ------------------------------------------------------------------ hostile JSON
@pytest.mark.parametrize(
    ("text", "match"),
    [
        (DEEP, "the config in its header is JSON nested too deeply to parse"),
        ("[1, 2]", "the config in its header must be a JSON object at the top level, got an array"),
        ('"gpt"', "must be a JSON object at the top level, got a string"),
        ("null", "must be a JSON object at the top level, got null"),
        ("{bad", "the config in its header is not valid JSON"),
        ('{"pad": "' + "x" * (1 << 20) + '"}', r"the config in its header is 1048587 characters \(at most 1048576\)"),
        (json.dumps({"vocab_size": -1}), r"\(config in its header\): invalid config"),
    ],
)
def test_hostile_config_in_the_header_is_refused(saved, work, text, match):
    _, path, _, weights_path = saved
    rewrite(weights_path, config_text=text)  # with a matching checksum, so the text itself is judged
    refused(path, match, weights_path)
    refused(path, match, weights_path, call=read_config)
    assert work == {"built": [], "read": []}


@pytest.mark.parametrize(
    ("text", "match"),
    [
        (DEEP, "config.json is JSON nested too deeply to parse"),
        ("[]", "config.json must be a JSON object at the top level, got an array"),
        ("3", "config.json must be a JSON object at the top level, got a number"),
        ("{" + " " * (1 << 20) + "}", "config.json is 1048578 bytes; a JSON file here is at most 1048576 bytes"),
        ('{"format": "multihead.gpt", "version": 1, "config": ' + DEEP + "}", "config.json is JSON nested too deeply"),
    ],
)
def test_hostile_config_json_is_refused(saved, work, text, match):
    # weights without a config in their header (written by another tool) are read with config.json
    _, path, config_path, weights_path = saved
    save_file(load_file(str(weights_path)), str(weights_path))
    config_path.write_text(text)
    refused(path, match, config_path)
    refused(path, match, config_path, call=read_config)
    assert work == {"built": [], "read": []}


# ------------------------------------------------------------------ malformed safetensors headers
def _break(case: str, header: dict, data: bytes) -> tuple[dict | bytes, bytes]:
    names = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])
    first, second = header[names[0]], header[names[1]]
    if case == "deep":
        return DEEP.encode(), data
    if case == "array":
        return b"[]", data
    if case == "metadata":
        header["__metadata__"]["config"] = {"nested": "object"}
    elif case == "dtype":
        first["dtype"] = "F7"
    elif case == "shape":
        first["shape"] = [True] * len(first["shape"])
    elif case == "size":
        first["shape"] = [d + 1 for d in first["shape"]]
    elif case == "overlap":
        second["data_offsets"] = [0, second["data_offsets"][1] - second["data_offsets"][0]]
    elif case == "offsets":
        first["data_offsets"] = [-4, first["data_offsets"][1]]
    elif case == "truncated":
        return header, data[:-12]
    elif case == "trailing":
        return header, data + b"\0" * 8
    return header, data


@pytest.mark.parametrize(
    ("case", "match"),
    [
        ("deep", "the header is JSON nested too deeply to parse"),
        ("array", "the header must be a JSON object at the top level, got an array"),
        ("metadata", "__metadata__ must map strings to strings"),
        ("dtype", "has an unknown dtype 'F7'"),
        ("shape", "has an invalid shape"),
        ("size", r"needs \d+ bytes but data_offsets \[\d+, \d+\] hold \d+"),
        ("overlap", r"starts at data byte 0, expected \d+ \(overlap or gap\)"),
        ("offsets", "has invalid data_offsets"),
        ("truncated", r"the tensors need (\d+) bytes of data but the file holds \d+ \(truncated\?\)"),
        ("trailing", r"the tensors need \d+ bytes of data but the file holds \d+"),
    ],
)
def test_malformed_headers_are_refused(saved, work, case, match):
    _, path, _, weights_path = saved
    n, header, raw = read_header(weights_path)
    write_raw(weights_path, *_break(case, header, raw[8 + n :]))
    refused(path, "model.safetensors is not a readable safetensors file: .*" + match, weights_path)
    assert work == {"built": [], "read": []}


def test_header_length_past_the_end_is_refused(saved, work):
    _, path, _, weights_path = saved
    raw = weights_path.read_bytes()
    for n in (2**63, len(raw) - 7, 200_000_000):
        weights_path.write_bytes(struct.pack("<Q", n) + raw[8:])
        refused(path, rf"its header length field says {n} bytes but {len(raw) - 8} bytes follow", weights_path)
    weights_path.write_bytes(raw[:5])
    refused(path, r"5 bytes, shorter than its 8-byte header length", weights_path)
    assert work == {"built": [], "read": []}


# ------------------------------------------------------------------ corrupted bytes
def test_corrupted_tensor_bytes_are_refused_by_their_checksum(saved, work):
    m, path, _, weights_path = saved
    n, header, raw = read_header(weights_path)
    data_start = 8 + n
    spans = {k: e["data_offsets"] for k, e in header.items() if k != "__metadata__"}
    for position in (data_start, data_start + 12345, len(raw) - 1):
        owner = next(k for k, (a, b) in spans.items() if a <= position - data_start < b)
        flipped = bytearray(raw)
        flipped[position] ^= 0x01  # one bit: still a valid float, only the checksum can tell
        weights_path.write_bytes(bytes(flipped))
        match = rf"model.safetensors is corrupt: the bytes of tensor '{re.escape(owner)}' do not match"
        refused(path, match, weights_path)
    assert work["built"] == []
    weights_path.write_bytes(raw)
    loaded = load_checkpoint(path)
    assert all(torch.equal(v, loaded.state_dict()[k]) for k, v in m.state_dict().items())


def test_a_corrupted_config_in_the_header_is_refused_by_its_checksum(saved, work):
    _, path, _, weights_path = saved
    raw = weights_path.read_bytes()
    assert raw.count(b"1e-05") == 1  # layer_norm_eps, inside the header's config text
    weights_path.write_bytes(raw.replace(b"1e-05", b"2e-05"))  # still valid JSON and a valid config
    refused(path, "model.safetensors is corrupt: its config does not match the sha256 checksum", weights_path)
    assert work == {"built": [], "read": []}


@pytest.mark.parametrize(
    "sums",
    [
        DEEP,
        "[]",
        json.dumps({"config": "0" * 64, "tensors": {}}),  # tensors not listed
        json.dumps({"config": "not hex", "tensors": {}}),
    ],
)
def test_a_malformed_checksum_entry_is_refused(saved, work, sums):
    _, path, _, weights_path = saved
    metadata = {**read_header(weights_path)[1]["__metadata__"], "sha256": sums}
    save_file(load_file(str(weights_path)), str(weights_path), metadata=metadata)
    refused(path, "the sha256 entry of its header", weights_path)
    assert work == {"built": [], "read": []}
