"""Typed errors raised by the library; the service maps them onto OpenAI error JSON."""

from __future__ import annotations


class NASDError(Exception):
    """Base class of every error this library raises on purpose."""


class InvalidRequestError(NASDError, ValueError):
    """A request the library cannot serve as given (bad prompt, bad sampling parameters).

    Attributes:
        param: the name of the offending parameter (``"max_tokens"``, ``"prompt"``...), or None.
    """

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class ContextLengthError(InvalidRequestError):
    """The prompt plus the requested tokens do not fit in the model's context window."""


class ModelLoadError(NASDError, RuntimeError):
    """A model or tokenizer could not be found or loaded."""


class EngineOverloadedError(NASDError):
    """The engine's waiting queue is full; retry later (the service answers 503/429)."""
