"""safetensors files written straight from tensors' memory and read back as views of a memory map: no copies."""
from __future__ import annotations

import json
import mmap
import os

import torch

from draftline.state_storage import FP8_DTYPE

_ST_DTYPES = {torch.int64: "I64", torch.uint8: "U8", torch.bfloat16: "BF16", torch.float32: "F32",
              FP8_DTYPE: "F8_E4M3"}
_TORCH_DTYPES = {v: k for k, v in _ST_DTYPES.items()}


def safetensors_chunks(tensors: dict[str, torch.Tensor | list[torch.Tensor]], metadata: dict[str, str]) -> list:
    """A safetensors file as buffers to write in order: header, then each tensor's own memory (no copy).

    A tensor may be given as row blocks (a list) whose concatenation along dim 0 it is: they are written one after
    another. The header keys are sorted (safetensors' own writer orders metadata arbitrarily), so identical
    extractions give identical bytes and sha256; resumption and checks by checksum rely on that.
    """
    header: dict = {"__metadata__": dict(sorted(metadata.items()))}
    offset, parts = 0, []
    for name in sorted(tensors):
        blocks = tensors[name] if isinstance(tensors[name], list) else [tensors[name]]
        blocks = [t.contiguous() for t in blocks]
        first = blocks[0]
        if any(t.dtype != first.dtype or t.shape[1:] != first.shape[1:] for t in blocks):
            raise ValueError(f"the row blocks of {name!r} differ in dtype or row shape; they cannot form one tensor")
        shape = [sum(t.shape[0] for t in blocks), *first.shape[1:]] if first.dim() else []
        size = sum(t.numel() * t.element_size() for t in blocks)
        header[name] = {"dtype": _ST_DTYPES[first.dtype], "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
        parts += [t.view(torch.uint8).reshape(-1).numpy() for t in blocks if t.numel()]
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the format allows trailing spaces; 8-byte alignment keeps tensors aligned
    return [len(raw).to_bytes(8, "little"), raw] + parts


def write_safetensors(path: str, tensors: dict[str, torch.Tensor | list[torch.Tensor]],
                      metadata: dict[str, str] | None = None) -> None:
    """Write host tensors to `path` without building the file in memory first."""
    with open(path, "wb") as f:
        for chunk in safetensors_chunks(tensors, metadata or {}):
            f.write(chunk)


def map_safetensors(path: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors of a file written by write_safetensors as views of a private memory map (pages are read on
    first touch; the map lives as long as a tensor does, so the file may be removed at once) and its metadata."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < 8:
            raise ValueError(f"{path} is {size} bytes, too short for a safetensors file")
        buf = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)  # copy-on-write: writable, so torch takes it as is
    n = int.from_bytes(buf[:8], "little")
    header = json.loads(bytes(buf[8:8 + n]))
    metadata = header.pop("__metadata__", {}) or {}
    start, out = 8 + n, {}
    for name, info in header.items():
        a, b = info["data_offsets"]
        dtype = _TORCH_DTYPES[info["dtype"]]
        flat = torch.frombuffer(buf, dtype=torch.uint8, count=b - a, offset=start + a) if b > a else \
            torch.empty(0, dtype=torch.uint8)
        out[name] = flat.view(dtype).view(info["shape"])
    return out, metadata
