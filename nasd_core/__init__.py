"""nasd_core: N-gram Assisted Speculative Decoding as a library (no Ray, no Redis).

from nasd_core import load_model, generate, SamplingParams, SpecConfig
model, tokenizer = load_model()          # the embedded SmolLM2-135M-Instruct
result = generate(model, tokenizer, "Hello", SamplingParams(max_tokens=32))
print(result.text, result.stats.tokens_per_step)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from nasd_core.lazy import lazy_attributes

# Each public name and the module that defines it, imported on first use: a program that needs
# only the configs (the pool's CLI, say) does not pay for torch and transformers.
_EXPORTS = {
    "ContextLengthError": "nasd_core.errors",
    "Engine": "nasd_core.engine.engine",
    "EngineConfig": "nasd_core.config",
    "GenerationResult": "nasd_core.engine.sequence",
    "IndexConfig": "nasd_core.config",
    "InvalidRequestError": "nasd_core.errors",
    "ModelConfig": "nasd_core.config",
    "ModelLoadError": "nasd_core.errors",
    "NASDError": "nasd_core.errors",
    "NGramIndex": "nasd_core.speculation.ngram",
    "RunnerConfig": "nasd_core.config",
    "SamplingParams": "nasd_core.config",
    "SpecConfig": "nasd_core.config",
    "SpecStats": "nasd_core.metrics",
    "generate": "nasd_core.generate",
    "load_model": "nasd_core.loader",
    "prompt_lookup": "nasd_core.speculation.ngram",
}
__all__ = [
    "ContextLengthError",
    "Engine",
    "EngineConfig",
    "GenerationResult",
    "IndexConfig",
    "InvalidRequestError",
    "ModelConfig",
    "ModelLoadError",
    "NASDError",
    "NGramIndex",
    "RunnerConfig",
    "SamplingParams",
    "SpecConfig",
    "SpecStats",
    "generate",
    "load_model",
    "prompt_lookup",
]

if TYPE_CHECKING:
    from nasd_core.config import (
        EngineConfig,
        IndexConfig,
        ModelConfig,
        RunnerConfig,
        SamplingParams,
        SpecConfig,
    )
    from nasd_core.engine.engine import Engine
    from nasd_core.engine.sequence import GenerationResult
    from nasd_core.errors import ContextLengthError, InvalidRequestError, ModelLoadError, NASDError
    from nasd_core.generate import generate
    from nasd_core.loader import load_model
    from nasd_core.metrics import SpecStats
    from nasd_core.speculation.ngram import NGramIndex, prompt_lookup


__getattr__, __dir__ = lazy_attributes(__name__, _EXPORTS)
