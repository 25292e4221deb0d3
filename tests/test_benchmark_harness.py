"""The benchmark harness's own logic on small inputs: metrics, ratios, result schema, workloads."""

from __future__ import annotations

import pytest

from benchmarks.single_stream import SYSTEMS, Totals, markdown_table
from benchmarks.workloads import WORKLOADS, make_workload
from nasd_core.metrics import SpecStats


def test_totals_summary_computes_rates_ratios_and_identity():
    stats = SpecStats()
    stats.record_step(num_drafted=4, num_accepted=3, num_emitted=4, source="request")
    stats.drafting_time_s, stats.decode_time_s = 0.01, 1.0
    cell = Totals(num_prompts=2, num_tokens=40, seconds=2.0, num_forwards=10, num_identical=1, stats=stats)
    row = cell.summary(baseline_tokens_per_s=10.0)
    assert row["tokens_per_s"] == 20.0
    assert row["speedup_vs_hf_greedy"] == 2.0
    assert row["tokens_per_forward"] == 4.0
    assert row["identical_to_hf_greedy"] is False
    assert row["acceptance_by_position"] == [1.0, 1.0, 1.0, 0.0]
    assert row["drafting_share"] == 0.01


def test_markdown_table_has_one_row_per_workload_and_flags_mismatches():
    plain = Totals(num_prompts=1, num_tokens=10, seconds=1.0, num_forwards=10, num_identical=1)
    wrong = Totals(num_prompts=1, num_tokens=10, seconds=0.5, num_forwards=5, num_identical=0)
    payload = {
        "workloads": {"code_edit": {s: (wrong if s == "nasd_on" else plain).summary(10.0) for s in SYSTEMS}}
    }
    table = markdown_table(payload).splitlines()
    assert len(table) == 3
    assert "code_edit (rep.)" in table[2]
    assert "2.00x ≠" in table[2]  # nasd_on's mismatch is flagged, not hidden


def test_workloads_are_deterministic_and_distinct():
    for name in WORKLOADS:
        first, again = make_workload(name, 3, seed=5), make_workload(name, 3, seed=5)
        assert first == again
        assert all(conv[-1]["role"] == "user" and conv[-1]["content"] for conv in first)
    assert make_workload("code_edit", 3, seed=1) != make_workload("code_edit", 3, seed=2)


def test_http_cell_summary_and_table():
    from benchmarks import http

    results = [
        {"text": "a", "tokens": 10, "ttft_s": 0.1, "itl_s": 0.02},
        {"text": "b", "tokens": 30, "ttft_s": 0.3, "itl_s": 0.04},
        {"text": "c", "tokens": 1, "ttft_s": 0.2, "itl_s": None},  # one token: no inter-token gap
    ]
    cell = http.summarise(results, elapsed=2.0)
    assert (cell["requests"], cell["tokens"], cell["tokens_per_s"]) == (3, 41, 20.5)
    assert cell["ttft_p50_ms"] == 200.0
    assert cell["itl_p50_ms"] == 30.0  # the None is left out, not counted as 0
    faster = {**cell, "tokens_per_s": 41.0, "ratio_to_off": 2.0}
    payload = {"results": {"1": {"repetitive": {"4": {"off": cell, "auto": faster, "identical": False}}}}}
    (row,) = http.markdown_table(payload).splitlines()[2:]
    assert row.startswith("| 1 | repetitive | 4 | 20.5 | 41.0 | 2.00x ≠ |")


def test_distinct_prompts_never_repeat_and_say_when_they_run_out():
    from benchmarks.workloads import distinct_prompts

    prompts = distinct_prompts(("creative", "code_edit"), 40, seed=1)
    assert len({repr(prompt) for prompt in prompts}) == 40
    assert prompts == distinct_prompts(("creative", "code_edit"), 40, seed=1)
    with pytest.raises(ValueError, match="different conversations"):
        distinct_prompts(("code_edit",), 1000)
