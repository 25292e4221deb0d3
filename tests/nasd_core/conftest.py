"""References several modules compare with, computed once per ``pytest`` run."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def single_runs(model, tokenizer) -> list[list[int]]:
    """Each of test_engine's prompts decoded alone (``single_sequence_runs``)."""
    from tests.nasd_core.test_engine import single_sequence_runs

    return single_sequence_runs(model, tokenizer)


@pytest.fixture(scope="session")
def paged_steps(model):
    """``fixed_and_packed_logits(model, "paged")``: the fixed-shape runner reading the paged
    KV-cache, and each step's (fixed, packed) logits."""
    from tests.nasd_core.test_step_graphs import fixed_and_packed_logits

    return fixed_and_packed_logits(model, "paged")
