"""A GGUF file of random weights for a given architecture and shape, with the embedded tokenizer.

For tests and benchmarks of architectures and sizes this repo has no file of (no network is
needed): the tokenizer fields are copied from the embedded SmolLM2 file, the weights are random
(the Linears Q8_0, the attention output and down projections Q4_0, the vocabulary Q8_0 and tied,
norms, Qwen2's query / key / value biases and Qwen3's per-head norms float32). Widths must be
multiples of 32 (the blocks').

    python -m tests.nasd_core.random_gguf qwen2 /tmp/qwen2.gguf --shape qwen2.5-0.5b
"""

from __future__ import annotations

import argparse
import functools
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from nasd_core.loader import embedded_gguf_path

Q = gguf.GGMLQuantizationType


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    head_dim: int | None = None  # None: hidden / heads


# A test's model, and Qwen2.5-0.5B's widths (its vocabulary is the embedded tokenizer's here).
SHAPES = {
    "tiny": Shape(64, 2, 4, 2, 128),
    "qwen2.5-0.5b": Shape(896, 24, 14, 2, 4864),
}


@functools.cache
def embedded_reader() -> gguf.GGUFReader:
    """gguf-py's reader of the embedded file (it parses the metadata for seconds: once a process)."""
    return gguf.GGUFReader(str(embedded_gguf_path()))


def tokenizer_fields(reader: gguf.GGUFReader, vocab_size: int | None = None) -> dict[str, tuple]:
    """``reader``'s tokenizer fields: name -> (value, type, item type). With ``vocab_size``, its
    first ``vocab_size`` tokens (a byte-level BPE's special tokens and bytes come first) and the
    merges among them: still a whole tokenizer, whose metadata a loader reads in milliseconds
    rather than the seconds 49k tokens and their merges take."""
    fields = {}
    for name, field in reader.fields.items():
        if name.startswith("tokenizer."):
            sub_type = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            fields[name] = (field.contents(), field.types[0], sub_type)
    if vocab_size is not None:
        tokens = fields["tokenizer.ggml.tokens"][0][:vocab_size]
        kept = set(tokens)
        merges = [
            merge
            for merge in fields["tokenizer.ggml.merges"][0]
            if all(part in kept for part in merge.split(" ")) and merge.replace(" ", "") in kept
        ]
        for name, value in (
            ("tokenizer.ggml.tokens", tokens),
            ("tokenizer.ggml.token_type", fields["tokenizer.ggml.token_type"][0][:vocab_size]),
            ("tokenizer.ggml.merges", merges),
        ):
            fields[name] = (value, *fields[name][1:])
    return fields


def write_random_gguf(
    target: Path, architecture: str, shape: Shape, seed: int = 0, vocab_size: int | None = None
) -> None:
    """Write ``target``: a random ``architecture`` model (llama, qwen2 or qwen3) of ``shape``, on the
    embedded tokenizer (its first ``vocab_size`` tokens: ``tokenizer_fields``). Qwen3's heads are
    128 wide unless ``shape`` says otherwise (transformers' GGUF config leaves its default)."""
    writer = gguf.GGUFWriter(str(target), architecture)
    tokenizer = tokenizer_fields(embedded_reader(), vocab_size)
    for name, (value, value_type, sub_type) in tokenizer.items():
        writer.add_key_value(name, value, value_type, sub_type=sub_type)
    head_dim = shape.head_dim or (128 if architecture == "qwen3" else shape.hidden // shape.heads)
    vocab = len(tokenizer["tokenizer.ggml.tokens"][0])
    writer.add_context_length(2048)
    writer.add_embedding_length(shape.hidden)
    writer.add_block_count(shape.layers)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    rng = np.random.default_rng(seed)

    def add(name: str, size: tuple[int, ...], kind: Q, scale: float, offset: float = 0.0) -> None:
        values = (offset + scale * rng.standard_normal(size)).astype(np.float32)
        writer.add_tensor(
            name, values if kind == Q.F32 else gguf.quants.quantize(values, kind), raw_dtype=kind
        )

    hidden, ffn = shape.hidden, shape.ffn
    add("token_embd.weight", (vocab, hidden), Q.Q8_0, 1.0)
    add("output_norm.weight", (hidden,), Q.F32, 0.1, 1.0)
    widths = {"attn_q": shape.heads * head_dim, "attn_k": shape.kv_heads * head_dim}
    widths["attn_v"] = widths["attn_k"]
    for layer in range(shape.layers):
        block = f"blk.{layer}"
        for name, rows in widths.items():
            add(f"{block}.{name}.weight", (rows, hidden), Q.Q8_0, 0.2)
            if architecture == "qwen2":
                add(f"{block}.{name}.bias", (rows,), Q.F32, 0.5)
        add(f"{block}.attn_output.weight", (hidden, shape.heads * head_dim), Q.Q4_0, 0.2)
        add(f"{block}.ffn_gate.weight", (ffn, hidden), Q.Q8_0, 0.2)
        add(f"{block}.ffn_up.weight", (ffn, hidden), Q.Q8_0, 0.2)
        add(f"{block}.ffn_down.weight", (hidden, ffn), Q.Q4_0, 0.2)
        add(f"{block}.attn_norm.weight", (hidden,), Q.F32, 0.1, 1.0)
        add(f"{block}.ffn_norm.weight", (hidden,), Q.F32, 0.1, 1.0)
        if architecture == "qwen3":
            add(f"{block}.attn_q_norm.weight", (head_dim,), Q.F32, 0.1, 1.0)
            add(f"{block}.attn_k_norm.weight", (head_dim,), Q.F32, 0.1, 1.0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("architecture", choices=["llama", "qwen2", "qwen3"])
    parser.add_argument("target", type=Path)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    args = parser.parse_args()
    write_random_gguf(args.target, args.architecture, SHAPES[args.shape])
    print(f"wrote {args.target}")


if __name__ == "__main__":
    main()
