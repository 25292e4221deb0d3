"""What NASD has made of a loaded model, in one typed object kept on it as ``model.nasd``.

The loader, the lean decoder, the compiled layers and the runner change a transformers model in
place; what they chose is recorded here rather than in loose attributes of the third-party object.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nasd_core.config import DEFAULT_FUSED_LAYERS, DEFAULT_INT8_ACTIVATIONS


@dataclass
class ModelState:
    """A model's NASD settings and what was done to it (``model_state``)."""

    # ModelConfig's numerics, applied at load (``quantized.set_int8_activations``).
    int8_activations: bool = DEFAULT_INT8_ACTIVATIONS
    fused_layers: bool = DEFAULT_FUSED_LAYERS
    # The runner's steps take ``lean_forward`` (``use_lean_decoder``).
    lean_decoder: bool = False
    # Every layer fits ``decoder_layers``' one C++ call (one block type per merged projection, no
    # biases, no per-head norms).
    layers_fit_fused: bool = False
    # ``decoder_layers``' weight arguments (norms, blocks, block kinds), gathered once.
    layer_weights: tuple[list[torch.Tensor], list[torch.Tensor], list[int]] | None = None
    # ``compile_layers`` ran: the layers are compiled, or ``compile_failure`` says why not.
    compile_tried: bool = False
    compile_failure: str | None = None

    @property
    def layers_compiled(self) -> bool:
        return self.compile_tried and self.compile_failure is None


def model_state(model: torch.nn.Module) -> ModelState:
    """``model``'s state, attached as ``model.nasd`` on first use (a model built without
    ``load_model`` starts from the defaults)."""
    state = model.__dict__.get("nasd")
    if state is None:
        state = model.nasd = ModelState()
    return state
