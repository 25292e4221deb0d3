"""nasd_core: N-gram Assisted Speculative Decoding as a library (no Ray, no Redis).

from nasd_core import load_model, generate, SamplingParams, SpecConfig
model, tokenizer = load_model()          # the embedded SmolLM2-135M-Instruct
result = generate(model, tokenizer, "Hello", SamplingParams(max_tokens=32))
print(result.text, result.stats.tokens_per_step)
"""

from nasd_core.config import EngineConfig, IndexConfig, ModelConfig, SamplingParams, SpecConfig
from nasd_core.engine.engine import Engine
from nasd_core.engine.sequence import GenerationResult
from nasd_core.errors import ContextLengthError, InvalidRequestError, ModelLoadError, NASDError
from nasd_core.generate import generate
from nasd_core.metrics import SpecStats
from nasd_core.models import load_model
from nasd_core.speculation.ngram import NGramIndex, prompt_lookup

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
    "SamplingParams",
    "SpecConfig",
    "SpecStats",
    "generate",
    "load_model",
    "prompt_lookup",
]
