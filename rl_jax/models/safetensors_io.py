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
import struct
from collections.abc import Iterable, Mapping
from pathlib import Path

import ml_dtypes
import numpy as np

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


def read_header(path: Path) -> tuple[dict, int]:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return header, 8 + n


def open_safetensors(path: str | Path) -> dict[str, np.ndarray]:
    """Name -> read-only memmap view of every tensor in one file (nothing read yet)."""
    path = Path(path)
    header, start = read_header(path)
    header.pop("__metadata__", None)
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    out = {}
    for name, info in header.items():
        if info["dtype"] not in _DTYPES:
            raise ValueError(
                f"{path}: tensor {name!r} has dtype {info['dtype']}, not one of {sorted(_DTYPES)}"
            )
        dtype = _DTYPES[info["dtype"]]
        b, e = info["data_offsets"]
        out[name] = raw[start + b : start + e].view(dtype).reshape(info["shape"])
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
