"""Shared fixtures: the real embedded model, loaded once per test session; deprecations fail.

transformers announces some deprecations (``past_key_values`` -> ``cache``, removed in 5.40)
through its logger rather than ``warnings``: any such message during a test fails it, so a
call this project makes that a coming release removes is caught before the release is.
FutureWarning and DeprecationWarning raised from this project's modules are errors too
(``filterwarnings`` in pyproject.toml).
"""

from __future__ import annotations

import logging
import os
import platform

# Triton's interpreter computes tl.dot with NumPy's OpenBLAS. Its Haswell kernel, which AVX2
# hosts get, sums a row of a small product by the row's place in the tile, so
# test_invariant_kernels would read the interpreter, not the kernel; the Sandybridge kernel sums
# every row alike. OpenBLAS reads this as NumPy loads, which importing torch does.
if platform.machine() == "x86_64":
    os.environ.setdefault("OPENBLAS_CORETYPE", "Sandybridge")
# `make test` runs two pytest processes side by side, with Ray's workers beside them: OpenMP
# threads spinning while they waited for work took the cores the others needed
# (docs/development.md). Read as torch loads OpenMP; the replicas and CLIs the tests start inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest
import torch


def pytest_configure(config) -> None:
    """Inductor's compiled kernels in the NASD cache for the whole run, this process and the
    replicas it starts: set before anything compiles, so that the next run loads them.

    On a 2-core host kept busy by other processes: the tests' Ray workers (replicas, Serve's
    proxy) at the tests' own priority, where Ray's default niceness of 15 left them a thirtieth
    of a core; and Serve's proxy given 30 s a ready check where its default is 5 (a starting
    proxy failed three checks in a row and Serve killed it).

    Without a GPU, Triton runs through its interpreter (test_invariant_kernels): the choice is
    made as triton is imported, which importing the runner does, so it is set here first."""
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from nasd_core.native.cache import keep_compiled_kernels

    keep_compiled_kernels()
    os.environ.setdefault("RAY_worker_niceness", "0")
    os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "30")


class _DeprecationRecorder(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "deprecated" in message.lower():
            self.messages.append(message)


@pytest.fixture(autouse=True)
def no_transformers_deprecations():
    recorder = _DeprecationRecorder()
    hf_logger = logging.getLogger("transformers")
    hf_logger.addHandler(recorder)
    try:
        yield
    finally:
        hf_logger.removeHandler(recorder)
    assert not recorder.messages, f"transformers deprecation during the test: {recorder.messages}"


@pytest.fixture(scope="session")
def model_and_tokenizer():
    """The embedded model in float32 (what transformers computes, the tests' reference)."""
    from nasd_core.config import ModelConfig
    from nasd_core.loader import load_model

    torch.manual_seed(0)
    return load_model(config=ModelConfig(dtype="float32"))


@pytest.fixture(scope="session")
def model(model_and_tokenizer):
    return model_and_tokenizer[0]


@pytest.fixture(scope="session")
def stock_model():
    """The embedded model with transformers' stock CPU kernels (plain ``nn.Linear`` layers)."""
    from nasd_core.config import ModelConfig
    from nasd_core.loader import load_model

    model, _ = load_model(config=ModelConfig(dtype="float32", cpu_fast_path=False))
    return model


@pytest.fixture(scope="session")
def gguf_model():
    """The embedded model on its GGUF blocks (``dtype="gguf"``, the server's and the library's CPU
    default)."""
    from nasd_core.config import ModelConfig
    from nasd_core.loader import load_model

    return load_model(config=ModelConfig(dtype="gguf"))[0]


@pytest.fixture(scope="session")
def tokenizer(model_and_tokenizer):
    return model_and_tokenizer[1]


@pytest.fixture(params=[False, True], ids=["float32_activations", "int8_activations"])
def int8_activations(request) -> bool:
    """Each QuantLinear kernel in turn (``ModelConfig.int8_activations``), whatever the default:
    the test's QuantLinears take it."""
    return request.param


@pytest.fixture
def gguf_model_at_int8_activations(gguf_model, int8_activations):
    """``gguf_model`` with the ``int8_activations`` fixture's setting, its own set back after."""
    from nasd_core.layers.quantized import set_int8_activations

    before = gguf_model.nasd.int8_activations
    set_int8_activations(gguf_model, int8_activations)
    yield gguf_model
    set_int8_activations(gguf_model, before)
