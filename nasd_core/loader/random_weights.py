"""Published architectures built with random weights: a step's cost and a memory plan depend on
a model's shapes, not its weights, so the benchmarks and the GPU tests time and plan these with
no weights to download or carry to a machine with no network."""

from __future__ import annotations

import torch

# qwen2-1.5b: Qwen2-1.5B's published config, the ~1.5B class a GPU replica serves (k8s/ serves
# Qwen2.5-1.5B, the same shape).
ARCHITECTURES = {
    "qwen2-1.5b": {
        "model_type": "qwen2",
        "hidden_size": 1536,
        "intermediate_size": 8960,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "max_position_embeddings": 32768,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
    },
}


def random_model(arch: str, dtype: str, device: str):
    """``arch`` (a key of ``ARCHITECTURES``) with random weights seeded at 0, built on ``device``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(ARCHITECTURES[arch])
    config = AutoConfig.for_model(spec.pop("model_type"), **spec)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    return model.eval()
