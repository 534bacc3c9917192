"""Safetensors files as memory-mapped numpy views (bfloat16 included, via ml_dtypes).

The `safetensors` package's numpy API has no bfloat16, and its framework APIs
copy whole tensors onto a device; a loader that fills device shards needs
slices of host tensors without reading the rest, which a memmap gives for free.
Format: 8-byte little-endian header length N, N bytes of JSON
{name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {...}},
then the raw little-endian data.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterable, Mapping
from pathlib import Path

import ml_dtypes
import numpy as np

from rl_jax.knobs import ConfigError

_DTYPES = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
_NAMES = {v: k for k, v in _DTYPES.items()}


class SafetensorsError(ConfigError):
    """A damaged or foreign safetensors file (the message names the file and tensor)."""


def read_header(path: Path) -> tuple[dict, int]:
    """The header of a safetensors file and where its data starts, checked against the file
    size: a truncated download fails here, naming the file, not in a reshape later."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise SafetensorsError(f"{path}: {size} bytes, too short for a safetensors file")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise SafetensorsError(
                f"{path}: header of {n} bytes does not fit the file's {size} bytes "
                "(truncated, or not a safetensors file)"
            )
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, ValueError) as e:
            raise SafetensorsError(f"{path}: header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise SafetensorsError(f"{path}: header is a JSON {type(header).__name__}, not an object")
    return header, 8 + n


def _check_entry(path: Path, name: str, info, data_bytes: int) -> tuple[np.dtype, list[int]]:
    """dtype and shape of one header entry, its byte range checked against the data."""
    if not isinstance(info, dict):
        raise SafetensorsError(f"{path}: tensor {name!r} has header entry {info!r}, not an object")
    if info.get("dtype") not in _DTYPES:
        raise SafetensorsError(
            f"{path}: tensor {name!r} has dtype {info.get('dtype')!r}, not one of {sorted(_DTYPES)}"
        )
    dtype = _DTYPES[info["dtype"]]
    shape, offsets = info.get("shape"), info.get("data_offsets")
    if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
        raise SafetensorsError(f"{path}: tensor {name!r} has shape {shape!r}, not a list of sizes")
    if not (
        isinstance(offsets, list)
        and len(offsets) == 2
        and all(type(o) is int for o in offsets)
        and 0 <= offsets[0] <= offsets[1]
    ):
        raise SafetensorsError(
            f"{path}: tensor {name!r} has data_offsets {offsets!r}, not [begin, end]"
        )
    b, e = offsets
    need = math.prod(shape) * dtype.itemsize
    if e - b != need:
        raise SafetensorsError(
            f"{path}: tensor {name!r} of shape {shape} {info['dtype']} needs {need} bytes, "
            f"its data_offsets span {e - b}"
        )
    if e > data_bytes:
        raise SafetensorsError(
            f"{path}: tensor {name!r} ends at byte {e} of the data but the file holds "
            f"{data_bytes} (truncated?)"
        )
    return dtype, shape


def _entries(path: Path) -> tuple[dict[str, tuple[np.dtype, list[int], int]], int]:
    """Name -> (dtype, shape, begin offset) of every tensor, and where the data starts."""
    if not path.is_file():
        raise SafetensorsError(f"{path}: no such file")
    header, start = read_header(path)
    header.pop("__metadata__", None)
    data_bytes = path.stat().st_size - start
    out = {}
    for name, info in header.items():
        dtype, shape = _check_entry(path, name, info, data_bytes)
        out[name] = (dtype, shape, info["data_offsets"][0])
    return out, start


def check_safetensors(path: str | Path) -> dict[str, tuple[np.dtype, list[int]]]:
    """Name -> (dtype, shape) of every tensor, each checked to lie inside the file; reads
    only the header, so it is cheap enough to run before any device work."""
    entries, _ = _entries(Path(path))
    return {name: (dtype, shape) for name, (dtype, shape, _) in entries.items()}


def open_safetensors(path: str | Path) -> dict[str, np.ndarray]:
    """Name -> read-only memmap view of every tensor in one file (nothing read yet)."""
    path = Path(path)
    entries, start = _entries(path)
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    out = {}
    for name, (dtype, shape, b) in entries.items():
        e = b + math.prod(shape) * dtype.itemsize
        out[name] = raw[start + b : start + e].view(dtype).reshape(shape)
    return out


def write_safetensors(
    path: str | Path,
    tensors: Mapping[str, np.ndarray] | Iterable[tuple[str, np.ndarray]],
    metadata: dict[str, str] | None = None,
) -> None:
    """Write tensors (any numpy dtype listed above) to one safetensors file."""
    items = list(tensors.items() if isinstance(tensors, Mapping) else tensors)
    header: dict = {"__metadata__": metadata or {"format": "pt"}}
    offset = 0
    for name, arr in items:
        dtype = np.dtype(arr.dtype)
        if dtype not in _NAMES:
            raise ValueError(f"tensor {name!r}: dtype {dtype} cannot be written to safetensors")
        header[name] = {
            "dtype": _NAMES[dtype],
            "shape": list(arr.shape),
            "data_offsets": [offset, offset + arr.nbytes],
        }
        offset += arr.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for _, arr in items:
            f.write(np.ascontiguousarray(arr).astype(arr.dtype.newbyteorder("<")).tobytes())
