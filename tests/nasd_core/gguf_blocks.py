"""Random GGUF blocks of every type the kernels take, for tests: a tensor's bytes as a file holds
them (``file_blocks``) and as the kernels take them (``random_blocks``)."""

from __future__ import annotations

import gguf
import numpy as np
import torch

from nasd_core.layers.quantized import BLOCK_FORMATS, FILE_BLOCKS
from nasd_core.loader.gguf import repack

# The K-quants gguf-py cannot quantize: random bytes with float16 scales in these bytes, of a size
# that gives weights of a normal layer's (Q3_K's d * 32 * 4, Q4_K's d * 63 * 15, Q5_K's d * 63 * 31,
# Q6_K's d * 127 * 32 near 1; dmin likewise).
RANDOM_FILE_SCALES = {
    11: (slice(108, 110), 8e-3),
    12: (slice(0, 4), 4e-3),
    13: (slice(0, 4), 2e-3),
    14: (slice(208, 210), 4e-4),
}


def file_blocks(kind: int, out_features: int, in_features: int, seed: int = 0) -> np.ndarray:
    """A tensor's bytes as a GGUF file holds them: gguf-py's quantization of normal weights, or
    random K-quant bytes (``RANDOM_FILE_SCALES``; in_features a multiple of 256)."""
    rng = np.random.default_rng(seed)
    if kind not in RANDOM_FILE_SCALES:
        weights = rng.standard_normal((out_features, in_features)).astype(np.float32)
        return gguf.quants.quantize(weights, gguf.GGMLQuantizationType(kind))
    raw = rng.integers(0, 256, (out_features, in_features // 256, FILE_BLOCKS[kind][1]), dtype=np.uint8)
    fields, top = RANDOM_FILE_SCALES[kind]
    count = (fields.stop - fields.start) // 2
    raw[..., fields] = rng.uniform(top / 4, top, (*raw.shape[:2], count)).astype(np.float16).view(np.uint8)
    return raw.reshape(out_features, -1)


def random_blocks(kind: int, out_features: int, in_features: int, seed: int = 0) -> torch.Tensor:
    """Blocks as the kernels take them (the repacked types: from whole super-blocks of the file,
    then the first in_features / 32 blocks of each row)."""
    if kind not in FILE_BLOCKS:
        return torch.from_numpy(file_blocks(kind, out_features, in_features, seed))
    raw = file_blocks(kind, out_features, -(-in_features // 256) * 256, seed)
    return torch.from_numpy(repack(raw, kind))[:, : in_features // 32 * BLOCK_FORMATS[kind][1]].contiguous()
