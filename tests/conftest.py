"""Shared fixtures: the real embedded model, loaded once per test session."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="session")
def model_and_tokenizer():
    from nasd_core.models import load_model

    torch.manual_seed(0)
    return load_model()


@pytest.fixture(scope="session")
def model(model_and_tokenizer):
    return model_and_tokenizer[0]


@pytest.fixture(scope="session")
def tokenizer(model_and_tokenizer):
    return model_and_tokenizer[1]
