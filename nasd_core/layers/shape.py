"""A decoder-only model's shape as its config gives it: what its memory and its kernels' row
widths depend on (the runner's memory plan, the CPU's batch-invariant thread count)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Bytes per logit the step keeps alive at once: the projection's output in the model's dtype,
# then float32 copies for processors and for the softmax verification samples from.
FLOAT32_LOGIT_COPIES = 2
# Rows of hidden-size activations alive at once inside a decoder layer (the residual stream,
# its normed copy, attention's output and projection, the MLP's input and output).
HIDDEN_COPIES = 6


@dataclass(frozen=True)
class ModelShape:
    """What a decoder-only model's memory depends on, read from its config."""

    num_layers: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    context: int
    dtype_bytes: int
    weight_bytes: int

    @classmethod
    def from_config(cls, config, dtype: torch.dtype, weight_bytes: int | None = None) -> ModelShape:
        """The shape of a transformers config; ``weight_bytes`` None: counted from the config
        (embeddings, an untied head, attention and MLP projections and their biases, norms)."""
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        hidden, inner, vocab = config.hidden_size, config.intermediate_size, config.vocab_size
        if weight_bytes is None:
            # Qwen2 always has biases on q, k and v; Llama-like configs say so.
            bias = getattr(config, "attention_bias", getattr(config, "model_type", None) == "qwen2")
            qkv = (hidden + bool(bias)) * (heads + 2 * kv_heads) * head_dim
            layer = qkv + heads * head_dim * hidden + 3 * hidden * inner + 2 * hidden
            tied = getattr(config, "tie_word_embeddings", False)
            params = vocab * hidden * (1 if tied else 2) + config.num_hidden_layers * layer + hidden
            weight_bytes = params * dtype.itemsize
        return cls(
            num_layers=config.num_hidden_layers,
            hidden_size=hidden,
            intermediate_size=inner,
            vocab_size=vocab,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            context=getattr(config, "max_position_embeddings", None) or 8192,
            dtype_bytes=dtype.itemsize,
            weight_bytes=weight_bytes,
        )

    @classmethod
    def from_model(cls, model) -> ModelShape:
        weight_bytes = sum(tensor.numel() * tensor.element_size() for tensor in model.parameters())
        return cls.from_config(model.config, model.dtype, weight_bytes)

    @property
    def groups(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    def layer_bytes(self, num_tokens: int) -> int:
        """Transient activations of one decoder layer over ``num_tokens`` positions."""
        qkv = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        per_token = HIDDEN_COPIES * self.hidden_size + 2 * qkv + 3 * self.intermediate_size
        return num_tokens * per_token * self.dtype_bytes

    def logits_bytes(self, num_rows: int) -> int:
        """The vocabulary projection of ``num_rows`` positions and its float32 copies."""
        return num_rows * self.vocab_size * (self.dtype_bytes + 4 * FLOAT32_LOGIT_COPIES)
