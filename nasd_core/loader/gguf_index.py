"""A GGUF file's tensors, read from its tensor index without parsing its metadata.

gguf-py's ``GGUFReader`` builds a numpy view of every metadata item before it reaches the
tensors: a 49k-token vocabulary is millions of views, 2.6 s on a Zen 5 for the embedded file,
at every load of its blocks. Here the metadata's values are stepped over by their lengths and
only the tensor index is read; each tensor's data is the view gguf-py gives (same dtype and
shape) over one memory map.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
ALIGNMENT_KEY = "general.alignment"
# GGUF metadata value types -> bytes of one value; 8 is a string, 9 an array.
_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY, _UINT32 = 8, 9, 4
# ggml types stored as plain numbers (any other is blocks, read as bytes [..., row bytes]).
_NUMERIC_DTYPES = {
    0: np.float32,
    1: np.float16,
    24: np.int8,
    25: np.int16,
    26: np.int32,
    27: np.int64,
    28: np.float64,
}


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    kind: int  # the ggml type (gguf.GGMLQuantizationType's value)
    data: np.ndarray  # a read-only view of the file


class _Cursor:
    """Little-endian reads from ``buffer``, advancing ``offset``."""

    def __init__(self, buffer: np.ndarray, path: Path) -> None:
        self.buffer, self.path, self.offset = buffer, path, 0

    def unpack(self, layout: str) -> tuple:
        values = struct.unpack_from(layout, self.buffer, self.offset)
        self.offset += struct.calcsize(layout)
        return values

    def string(self) -> str:
        (length,) = self.unpack("<Q")
        start, self.offset = self.offset, self.offset + length
        return bytes(self.buffer[start : self.offset]).decode("utf-8")

    def skip_value(self, value_type: int) -> None:
        if value_type in _SCALAR_BYTES:
            self.offset += _SCALAR_BYTES[value_type]
        elif value_type == _STRING:
            (length,) = self.unpack("<Q")
            self.offset += length
        elif value_type == _ARRAY:
            item_type, count = self.unpack("<IQ")
            if item_type in _SCALAR_BYTES:
                self.offset += count * _SCALAR_BYTES[item_type]
            else:
                for _ in range(count):
                    self.skip_value(item_type)
        else:
            raise ValueError(f"{self.path.name}: unknown GGUF value type {value_type}")


def read_tensors(path: str | Path) -> list[GGUFTensor]:
    """The tensors of the GGUF file at ``path``, in the file's order.

    Raises:
        ValueError: not a GGUF file, a version or byte order this reader does not know, a bad
            alignment, a tensor named twice, of an unknown type or past the file's end.
    """
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import quant_shape_to_byte_shape

    path = Path(path)
    buffer = np.memmap(path, mode="r")
    if bytes(buffer[:4]) != GGUF_MAGIC:
        raise ValueError(f"{path.name} is not a GGUF file")
    cursor = _Cursor(buffer, path)
    cursor.offset = 4
    (version,) = cursor.unpack("<I")
    if version not in SUPPORTED_VERSIONS:  # a big-endian file reads as version 0x0N000000
        raise ValueError(f"{path.name}: GGUF version {version} (little-endian 2 or 3 is read)")
    num_tensors, num_fields = cursor.unpack("<QQ")
    alignment = DEFAULT_ALIGNMENT
    for _ in range(num_fields):
        key = cursor.string()
        (value_type,) = cursor.unpack("<I")
        if key != ALIGNMENT_KEY:
            cursor.skip_value(value_type)
            continue
        # A wrong alignment would read every tensor from the wrong offset: refused, as gguf-py does.
        (alignment,) = cursor.unpack("<I") if value_type == _UINT32 else (0,)
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"{path.name}: {ALIGNMENT_KEY} is not a power of two as a uint32")
    index = []
    for _ in range(num_tensors):
        name = cursor.string()
        (num_dims,) = cursor.unpack("<I")
        dims = cursor.unpack(f"<{num_dims}Q")
        kind, offset = cursor.unpack("<IQ")
        index.append((name, dims, kind, offset))
    data_start = -(-cursor.offset // alignment) * alignment
    if len({name for name, *_ in index}) < len(index):
        raise ValueError(f"{path.name} names a tensor twice")
    tensors = []
    for name, dims, kind, offset in index:
        shape = tuple(reversed(dims))  # rows first, as numpy and torch index
        start = data_start + offset
        if kind in _NUMERIC_DTYPES:
            dtype = np.dtype(_NUMERIC_DTYPES[kind])
            num_bytes = int(np.prod(shape)) * dtype.itemsize
        else:
            quant_type = GGMLQuantizationType(kind)
            block_size, type_size = GGML_QUANT_SIZES[quant_type]
            dtype = np.dtype(np.uint8)
            num_bytes = int(np.prod(shape)) * type_size // block_size
            shape = quant_shape_to_byte_shape(shape, quant_type)
        if start + num_bytes > len(buffer):
            raise ValueError(f"{path.name} ends inside tensor {name} (a partial download?)")
        view = buffer[start : start + num_bytes].view(dtype).reshape(shape)
        tensors.append(GGUFTensor(name, kind, view))
    return tensors
