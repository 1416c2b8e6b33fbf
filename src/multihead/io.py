"""Crash-safe file writes, and JSON and safetensors readers that trust nothing in the file.

The writers save the package's files (checkpoints, configs, run records,
reports, figures) and the readers open the checkpoints and JSON files it must
not trust, for every layer alike (models, train, tools, commands). The module
depends on nothing else in the package, so any of them may import it.

Writing (:func:`write_atomic`, :func:`write_bytes_atomic`,
:func:`write_text_atomic`, :func:`save_safetensors`)::

    run/
      .model.safetensors.<pid>.<32 hex>.tmp/   private staging directory
          model.safetensors                    written here (with any temp file of
                                               safetensors' own writer), fsynced
      model.safetensors                        <- os.replace(staged file, target)

``os.replace`` within one directory is atomic: a reader (or a kill -9 at any
moment) sees the previous file or the new one, never a part. A killed writer
leaves at most its staging directory behind; the next write to the same target
removes the staging directories, and the temp files of the same
``.<name>.<pid>.<32 hex>.tmp`` form, whose process no longer runs on this
machine. Nothing else is touched: a live writer's staging directory is left
alone, as is every name not of exactly that form. The new file gets the mode
a plain ``open`` would give it: an existing target's mode, or 0o666 less the
umask (0o644 under the usual 022) for a new one, although safetensors' own
writer creates 0o600 files.

Reading (:func:`read_safetensors_header`, :func:`read_tensors`) checks every
number of the header before it is used: the 8-byte header length against the
file size and a 100 MB cap, the JSON (nesting, top-level type), each tensor's
dtype, shape and byte range, and that the ranges tile the data section
exactly. Tensor bytes are read from the same open file (so a checkpoint
replaced meanwhile cannot mix into the read) into fresh buffers and can be
checked against sha256 digests (:func:`tensor_sha256`). The format assumes a
little-endian machine, as safetensors does (every x86 CPU is one).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import stat
import struct
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch

__all__ = [
    "MAX_HEADER_BYTES",
    "FLOAT_DTYPES",
    "TensorEntry",
    "SafetensorsHeader",
    "write_atomic",
    "write_bytes_atomic",
    "write_text_atomic",
    "save_safetensors",
    "remove_stale_temps",
    "parse_json_object",
    "read_json_file",
    "read_safetensors_header",
    "read_tensors",
    "tensor_sha256",
]

MAX_HEADER_BYTES = 100_000_000  # the cap of safetensors' own reader
FLOAT_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64}
_OTHER_DTYPES = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
}
_DTYPE_BYTES = {
    **{name: 1 for name in ("BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0")},
    **{name: 2 for name in ("I16", "U16", "F16", "BF16")},
    **{name: 4 for name in ("I32", "U32", "F32")},
    **{name: 8 for name in ("I64", "U64", "F64", "C64")},
}
_TEMP_TAIL = re.compile(r"(\d+)\.[0-9a-f]{32}\.tmp")  # after ".<target name>."


# ------------------------------------------------------------------ writing
def _temp_path(target: Path) -> Path:
    return target.with_name(f".{target.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp")


def _process_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True  # perhaps another thread of this process, writing now
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    except (OverflowError, ValueError):
        return False  # not a pid this system can have
    return True


def remove_stale_temps(target: str | os.PathLike) -> list[Path]:
    """Remove what killed writers of ``target`` left behind.

    Only entries beside ``target`` named ``.<target name>.<pid>.<32 hex>.tmp``
    (this module's staging directories, and the temp files earlier versions
    wrote) whose ``pid`` is not a running process are removed.

    Returns:
        the removed paths.
    """
    target = Path(target)
    prefix = f".{target.name}."
    removed = []
    try:
        entries = list(os.scandir(target.parent))
    except (FileNotFoundError, NotADirectoryError):
        return removed
    for entry in entries:
        if not entry.name.startswith(prefix):
            continue
        match = _TEMP_TAIL.fullmatch(entry.name[len(prefix) :])
        if match is None or _process_alive(int(match[1])):
            continue
        path = Path(entry.path)
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        removed.append(path)
    return removed


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(target: str | os.PathLike, write: Callable[[Path], None]) -> Path:
    """Replace ``target`` as a whole by what ``write(staged_path)`` writes.

    ``write`` gets a path in a private staging directory beside ``target``
    (an empty file already exists there; it may overwrite or replace it).
    The result is fsynced, given the usual mode and renamed over ``target``.

    Returns:
        ``target`` as a Path.
    """
    target = Path(target)
    remove_stale_temps(target)
    staging = _temp_path(target)
    os.mkdir(staging, 0o700)
    try:
        staged = staging / target.name
        fd = os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        try:
            # what a plain open() gives: the existing file's mode, else 0o666 less the umask
            mode = stat.S_IMODE(os.stat(target).st_mode) if target.is_file() else stat.S_IMODE(os.fstat(fd).st_mode)
        finally:
            os.close(fd)
        write(staged)
        os.chmod(staged, mode)
        _fsync(staged)
        os.replace(staged, target)
        try:
            _fsync(target.parent)  # the rename itself survives a power cut
        except OSError:
            pass  # directories cannot be opened for fsync on every system
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def write_bytes_atomic(path: str | os.PathLike, data: bytes) -> Path:
    """Write ``data`` to ``path`` with :func:`write_atomic`."""
    return write_atomic(path, lambda staged: staged.write_bytes(data))


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` with :func:`write_atomic`."""
    return write_atomic(path, lambda staged: staged.write_text(text, encoding="utf-8"))


def save_safetensors(tensors: dict[str, torch.Tensor], path: str | os.PathLike, metadata: dict[str, str]) -> Path:
    """``safetensors.torch.save_file`` through :func:`write_atomic`."""
    from safetensors.torch import save_file

    return write_atomic(path, lambda staged: save_file(tensors, str(staged), metadata=metadata))


def tensor_sha256(tensor: torch.Tensor) -> str:
    """Hex sha256 of the bytes safetensors stores for ``tensor`` (row-major, little-endian)."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)  # (numel,)
    return hashlib.sha256(flat.view(torch.uint8).numpy()).hexdigest()  # (numel * itemsize,) bytes


# ------------------------------------------------------------------ JSON
class _JSONProblem(ValueError):
    pass


_JSON_TYPES = {list: "an array", str: "a string", int: "a number", float: "a number", bool: "a boolean"}


def _json_object(text: str | bytes) -> dict[str, Any]:
    try:
        data = json.loads(text)
    except RecursionError:
        raise _JSONProblem("is JSON nested too deeply to parse") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, integers over the digit limit
        raise _JSONProblem(f"is not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise _JSONProblem(f"must be a JSON object at the top level, got {_JSON_TYPES.get(type(data), 'null')}")
    return data


def parse_json_object(text: str | bytes, source: str) -> dict[str, Any]:
    """``json.loads`` that refuses, with one ValueError naming ``source``,
    invalid or too deeply nested JSON and anything but an object at the top."""
    try:
        return _json_object(text)
    except _JSONProblem as e:
        raise ValueError(f"{source} {e}") from None


def read_json_file(path: str | os.PathLike, max_bytes: int = 1 << 20) -> dict[str, Any]:
    """Parse the JSON object in ``path``, refusing files over ``max_bytes``.

    Raises:
        FileNotFoundError: no such file.
        ValueError: too large, invalid, too deeply nested, or not an object.
    """
    with open(path, "rb") as f:
        raw = f.read(max_bytes + 1)
    if len(raw) > max_bytes:
        size = os.stat(path).st_size
        raise ValueError(f"{path} is {size} bytes; a JSON file here is at most {max_bytes} bytes")
    return parse_json_object(raw, str(path))


# ------------------------------------------------------------------ reading safetensors
@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors header (``start``/``end``: absolute file offsets)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int


@dataclass(frozen=True)
class SafetensorsHeader:
    """The checked header of a safetensors file."""

    path: str
    tensors: dict[str, TensorEntry]
    metadata: dict[str, str]


def _read_exact(f: BinaryIO, out: memoryview) -> None:
    done = 0
    while done < len(out):
        n = f.readinto(out[done:])
        if not n:
            raise EOFError(f"file ended {len(out) - done} bytes early")
        done += n


def _is_count(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def read_safetensors_header(f: BinaryIO, path: str | os.PathLike) -> SafetensorsHeader:
    """Read and check the header of the safetensors file open as ``f``.

    Raises:
        ValueError: "<path> is not a readable safetensors file: <problem>".
    """

    def bad(problem: str) -> ValueError:
        return ValueError(f"{path} is not a readable safetensors file: {problem}")

    size = os.fstat(f.fileno()).st_size
    if size < 8:
        raise bad(f"{size} bytes, shorter than its 8-byte header length (truncated?)")
    f.seek(0)
    (n,) = struct.unpack("<Q", f.read(8))
    if n > size - 8 or n > MAX_HEADER_BYTES:
        raise bad(f"its header length field says {n} bytes but {size - 8} bytes follow (cap {MAX_HEADER_BYTES})")
    raw = bytearray(n)
    try:
        _read_exact(f, memoryview(raw))
    except EOFError as err:
        raise bad(f"{err} (truncated?)") from None
    try:
        header = _json_object(bytes(raw))
    except _JSONProblem as e:
        raise bad(f"the header {e}") from None
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise bad("__metadata__ must map strings to strings")
    data_start = 8 + n
    entries = {}
    for name, e in header.items():
        if not isinstance(e, dict):
            raise bad(f"entry {name!r} is not an object")
        dtype, shape, offsets = e.get("dtype"), e.get("shape"), e.get("data_offsets")
        if dtype not in _DTYPE_BYTES:
            raise bad(f"tensor {name!r} has an unknown dtype {dtype!r}")
        if not isinstance(shape, list) or len(shape) > 64 or not all(_is_count(d) for d in shape):
            raise bad(f"tensor {name!r} has an invalid shape {shape!r}")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_count(o) for o in offsets)):
            raise bad(f"tensor {name!r} has invalid data_offsets {offsets!r}")
        nbytes = math.prod(shape) * _DTYPE_BYTES[dtype]
        if offsets[1] - offsets[0] != nbytes:
            held = offsets[1] - offsets[0]
            raise bad(f"tensor {name!r} ({dtype} {shape}) needs {nbytes} bytes but data_offsets {offsets} hold {held}")
        entries[name] = TensorEntry(name, dtype, tuple(shape), data_start + offsets[0], data_start + offsets[1])
    end = data_start
    for e in sorted(entries.values(), key=lambda e: (e.start, e.end)):
        if e.start != end:
            where, expected = e.start - data_start, end - data_start
            raise bad(f"tensor {e.name!r} starts at data byte {where}, expected {expected} (overlap or gap)")
        end = e.end
    if end != size:
        need, held = end - data_start, size - data_start
        raise bad(f"the tensors need {need} bytes of data but the file holds {held} (truncated?)")
    return SafetensorsHeader(str(path), entries, dict(metadata))


def read_tensors(
    f: BinaryIO, header: SafetensorsHeader, sha256: dict[str, str] | None = None
) -> dict[str, torch.Tensor]:
    """The tensors of ``header``, read from ``f`` into fresh CPU tensors.

    Args:
        f: the file ``header`` was read from (still open).
        header: from :func:`read_safetensors_header`.
        sha256: when given, name -> hex digest of each tensor's bytes; a
            tensor whose bytes differ is refused.

    Raises:
        ValueError: a dtype this reader cannot build, or a checksum mismatch.
    """
    out = {}
    for e in sorted(header.tensors.values(), key=lambda e: e.start):
        dtype = FLOAT_DTYPES.get(e.dtype) or _OTHER_DTYPES.get(e.dtype)
        if dtype is None:
            raise ValueError(f"{header.path}: tensor {e.name!r} has dtype {e.dtype}, which this reader cannot load")
        buf = torch.empty(e.end - e.start, dtype=torch.uint8)  # (nbytes,), size checked against the file
        f.seek(e.start)
        try:
            _read_exact(f, memoryview(buf.numpy()))
        except EOFError as err:
            raise ValueError(f"{header.path} is not a readable safetensors file: {err} (truncated?)") from None
        if sha256 is not None and hashlib.sha256(buf.numpy()).hexdigest() != sha256[e.name]:
            raise ValueError(
                f"{header.path} is corrupt: the bytes of tensor {e.name!r} do not match the sha256 checksum "
                "stored when the file was written"
            )
        out[e.name] = buf.view(dtype).reshape(e.shape)  # (nbytes,) -> (numel,) -> shape
    return out
