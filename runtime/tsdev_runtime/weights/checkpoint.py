"""A safetensors checkpoint as byte ranges: which files, and where each tensor lies in them.

A safetensors file is 8 bytes (little-endian u64 N), N bytes of JSON ({name: {dtype, shape,
data_offsets: [begin, end]}}, plus "__metadata__"), then the data; offsets count from the end of the
header. Reading the headers alone gives every name, shape and byte range, so a load can be checked and
planned before any data is read, and the data can be read by several threads straight into a staging
buffer (`tsdev_runtime.weights.pinned`).
"""
import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

DTYPES = {name: getattr(torch, attr) for name, attr in {
    "BOOL": "bool", "U8": "uint8", "I8": "int8", "I16": "int16", "I32": "int32", "I64": "int64",
    "U16": "uint16", "U32": "uint32", "U64": "uint64", "F16": "float16", "BF16": "bfloat16",
    "F32": "float32", "F64": "float64", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
}.items() if hasattr(torch, attr)}
MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a checkpoint file: `nbytes` bytes at absolute file offset `offset`."""
    name: str
    path: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def checkpoint_files(model_dir: Path) -> list[Path]:
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [s for s in shards if not (model_dir / s).is_file()]
        if missing:
            raise FileNotFoundError(f"{index} names shards that are not there: {', '.join(missing)}")
        return [model_dir / s for s in shards]
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    raise FileNotFoundError(
        f"{model_dir} has neither model.safetensors nor model.safetensors.index.json: "
        "pass a Hugging Face checkpoint directory with safetensors weights"
    )


def read_header(path: Path) -> list[TensorEntry]:
    """The tensors of one safetensors file, in file order; checks that every range lies inside the file."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        (header_len,) = struct.unpack("<Q", head) if len(head) == 8 else (None,)
        if header_len is None or header_len > min(MAX_HEADER_BYTES, size - 8):
            raise ValueError(f"{path} is not a safetensors file (or is truncated): its header length is unreadable")
        header = json.loads(f.read(header_len))
    data_start, entries = 8 + header_len, []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in DTYPES:
            raise ValueError(f"{path.name}: {name} has dtype {info['dtype']}, which this torch cannot hold")
        begin, end = info["data_offsets"]
        dtype, shape = DTYPES[info["dtype"]], tuple(info["shape"])
        if end - begin != math.prod(shape) * dtype.itemsize or data_start + end > size:
            raise ValueError(f"{path.name}: {name} has a byte range that does not fit its shape or the file "
                             "(a truncated or damaged checkpoint): download it again")
        entries.append(TensorEntry(name, path, dtype, shape, data_start + begin, end - begin))
    return sorted(entries, key=lambda e: e.offset)


def read_entries(files: list[Path]) -> list[TensorEntry]:
    """Every tensor of the checkpoint, file by file, each file in data order (the order reads go best)."""
    return [entry for path in files for entry in read_header(path)]


def read_into(fd: int, view: memoryview, offset: int, what: str) -> None:
    """Fill `view` from file offset `offset` (os.preadv: no intermediate bytes object; the GIL is released)."""
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise OSError(f"{what}: the file ended early (a truncated checkpoint): download it again")
        done += n
