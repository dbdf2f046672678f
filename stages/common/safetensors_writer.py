"""A Hugging Face model folder's weights written one tensor at a time: `model.safetensors`, or above
`max_shard_size` shards `model-0000i-of-0000n.safetensors` with `model.safetensors.index.json`, split by
huggingface_hub's own rule over the entries in the order given, as `save_pretrained` splits its state
dict. Each file is byte for byte what the safetensors library writes for the same tensors, and each tensor
is made only when its bytes are written, so a model far larger than the memory at hand can be saved.
(safetensors: an 8-byte little-endian header length, a JSON header padded with spaces to a multiple of 8,
then the tensors' bytes in the order the header lists them: descending dtype, then name, as the library
sorts them.)"""

from __future__ import annotations

import json
import struct
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

# safetensors' dtype codes, in the order of its Dtype enum (the order it sorts a file's tensors by)
DTYPE_CODES = {
    torch.bool: "BOOL",
    torch.uint8: "U8",
    torch.int8: "I8",
    torch.float8_e5m2: "F8_E5M2",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.int16: "I16",
    torch.uint16: "U16",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int32: "I32",
    torch.uint32: "U32",
    torch.float32: "F32",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.uint64: "U64",
}
DTYPE_RANK = {dtype: i for i, dtype in enumerate(DTYPE_CODES)}


@dataclass(frozen=True)
class Entry:
    """One tensor of the folder: its name, shape and dtype known up front, its values made when written."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    make: Callable[[], torch.Tensor]
    parameter: bool = True  # counted in the index's total_parameters (a buffer is not)

    @property
    def nbytes(self) -> int:
        return torch.Size(self.shape).numel() * self.dtype.itemsize


def write_weights(folder: Path, entries: Iterable[Entry], max_shard_size: int | str) -> list[str]:
    """Write the entries' tensors as `save_pretrained(folder, max_shard_size=...)` would; the file names."""
    from huggingface_hub import split_torch_state_dict_into_shards

    entries = {e.name: e for e in entries}
    unknown = sorted({str(e.dtype) for e in entries.values() if e.dtype not in DTYPE_CODES})
    if unknown:
        raise ValueError(f"safetensors_writer: no safetensors code for {', '.join(unknown)}")
    stand_ins = {name: torch.empty(e.shape, dtype=e.dtype, device="meta") for name, e in entries.items()}
    split = split_torch_state_dict_into_shards(
        stand_ins, filename_pattern="model{suffix}.safetensors", max_shard_size=max_shard_size
    )
    for filename, names in split.filename_to_tensors.items():
        write_file(folder / filename, [entries[n] for n in names], {"format": "pt"})
    if split.is_sharded:
        total = sum(torch.Size(e.shape).numel() for e in entries.values() if e.parameter)
        index = {"metadata": {"total_parameters": total, **split.metadata}, "weight_map": split.tensor_to_filename}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return list(split.filename_to_tensors)


def write_file(path: Path, entries: list[Entry], metadata: dict[str, str]) -> None:
    """One safetensors file: the header from the entries' shapes, then each tensor's bytes as it is made."""
    if sys.byteorder != "little":
        raise RuntimeError("safetensors_writer: safetensors stores little-endian bytes; this machine is big-endian")
    entries = sorted(entries, key=lambda e: (-DTYPE_RANK[e.dtype], e.name))
    header: dict = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for e in entries:
        header[e.name] = {
            "dtype": DTYPE_CODES[e.dtype],
            "shape": list(e.shape),
            "data_offsets": [offset, offset + e.nbytes],
        }
        offset += e.nbytes
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for e in entries:
            tensor = e.make().detach().to("cpu").contiguous()
            if tuple(tensor.shape) != tuple(e.shape) or tensor.dtype != e.dtype:
                raise RuntimeError(
                    f"safetensors_writer: {e.name} was announced as {e.dtype} {list(e.shape)}, made as "
                    f"{tensor.dtype} {list(tensor.shape)}"
                )
            f.write(tensor.reshape(-1).view(torch.uint8).numpy().data)
            del tensor
