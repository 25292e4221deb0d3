"""The benchmark harness's own logic on small inputs: metrics, ratios, result schema, workloads."""

from __future__ import annotations

import pytest

from benchmarks.report import SUITES
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


def test_quick_run_is_held_against_the_full_runs_figures_for_the_same_prompts():
    from benchmarks.single_stream import ratios

    def row(per_prompt: list[list[float]]) -> dict:
        tokens, seconds = sum(t for t, _ in per_prompt), sum(s for _, s in per_prompt)
        return {"tokens_per_s": tokens / seconds, "per_prompt": per_prompt}

    # Over five prompts auto is 2x greedy; on the first prompt alone it is 4x.
    full = {
        "meta": {"num_prompts_per_workload": 5},
        "workloads": {
            "code_edit": {
                "hf_greedy": row([[100, 10.0]] * 5),
                "nasd_auto": row([[100, 2.5]] + [[100, 5.625]] * 4),
            }
        },
    }
    quick = {"meta": {"num_prompts_per_workload": 1}, "workloads": {}}
    assert ratios(full) == {"code_edit/nasd_auto": 2.0}
    assert ratios(full, like=quick) == {"code_edit/nasd_auto": 4.0}


def test_concurrency_cell_pools_its_runs():
    from benchmarks.concurrency import MODES, CellRun, run_order

    assert run_order(1) == list(MODES)
    assert run_order(2).count("off") == run_order(2).count("auto") == 2 and run_order(2).count("on") == 1
    cell = CellRun(num_requests=4, num_tokens=100, seconds=4.0, first_token_s=[0.1, 0.3])
    cell.per_token_s = [0.02] * 99 + [0.5]
    summary = cell.summary()
    assert (summary["tokens_per_s"], summary["ttft_p50_ms"], summary["itl_p50_ms"]) == (25.0, 200.0, 20.0)
    assert summary["itl_p99_ms"] > 20.0


def test_workloads_are_deterministic_and_distinct():
    for name in WORKLOADS:
        first, again = make_workload(name, 3, seed=5), make_workload(name, 3, seed=5)
        assert first == again
        assert all(conv[-1]["role"] == "user" and conv[-1]["content"] for conv in first)
    assert make_workload("code_edit", 3, seed=1) != make_workload("code_edit", 3, seed=2)


def test_cell_summary_leaves_out_a_single_tokens_missing_gap():
    from benchmarks.serving import summarise

    results = [
        {"text": "a", "tokens": 10, "ttft_s": 0.1, "itl_s": 0.02},
        {"text": "b", "tokens": 30, "ttft_s": 0.3, "itl_s": 0.04},
        {"text": "c", "tokens": 1, "ttft_s": 0.2, "itl_s": None},  # one token: no inter-token gap
    ]
    cell = summarise(results, elapsed=2.0)
    assert (cell["requests"], cell["tokens"], cell["tokens_per_s"]) == (3, 41, 20.5)
    assert cell["ttft_p50_ms"] == 200.0
    assert cell["itl_p50_ms"] == 30.0  # the None is left out, not counted as 0


def test_http_categories_mixed_cell_rates_and_table():
    """The mixed cell reads each category over its own requests' seconds (not the run's), and
    its columns, and the arrivals cell's, join the table only where the payload has them (older
    results have none)."""
    from benchmarks import http_categories

    results = [{"tokens": 10, "seconds": 1.0}, {"tokens": 30, "seconds": 1.0}, {"tokens": 20, "seconds": 4.0}]
    rates = http_categories.category_rates(["a", "b", "a"], results)
    assert rates == {"a": 6.0, "b": 30.0}
    with pytest.raises(ValueError):
        http_categories.category_rates(["a"], results)
    mode = {"tokens_per_s": 20.0}
    cell = {"off": mode, "auto_over_off": 1.5, "control_over_off": 1.0, "identical": True}
    overall = {"off_tok_s": 20.0, "auto_over_off": 1.5, "control_over_off": 1.0}
    payload = {"cells": {"creative": {"8": cell}}, "overall": {"8": overall}}
    assert "mixed" not in http_categories.markdown_table(payload)

    def stream(auto: float, control: float, creative_auto: float, creative_control: float) -> dict:
        creative = {"auto_over_off": creative_auto, "control_over_off": creative_control}
        return {"auto_over_off": auto, "control_over_off": control, "categories": {"creative": creative}}

    payload["mixed"] = stream(1.3, 0.99, 0.8, 1.01)
    settings, _, header, _, creative, total = http_categories.markdown_table(payload).splitlines()
    assert "every other setting its default" in settings and "except" not in settings
    payload["changed_settings"] = {"probe_max_rows": 8}  # a setting serve run does not have is named
    assert "except `probe_max_rows=8`" in http_categories.markdown_table(payload).splitlines()[0]
    assert header.endswith("| mixed C=8 auto / off | mixed control / off |")
    assert creative == "| creative | 20.0 | 1.50x | 1.00x | 0.80x | 1.01x |"
    assert total == "| all | 20.0 | **1.50x** | 1.00x | **1.30x** | 0.99x |"
    payload["arrivals"] = stream(1.1, 1.02, 0.97, 0.95)
    _, _, header, _, creative, total = http_categories.markdown_table(payload).splitlines()
    assert header.endswith("| mixed control / off | arrivals auto / off | arrivals control / off |")
    assert creative.endswith("| 0.80x | 1.01x | 0.97x | 0.95x |")
    assert total.endswith("| **1.30x** | 0.99x | **1.10x** | 1.02x |")


def test_http_categories_rounds_are_pooled_and_each_kept(monkeypatch):
    """With repeats, a cell's row reads its rounds pooled (tokens over seconds summed), keeps
    each round's ratios, rotates the servers' order once more each round, and adds up the
    engine counters; the servers' part is a stand-in that answers each round at set rates."""
    from benchmarks import http_categories

    rates = {"off": [10.0, 20.0], "auto": [15.0, 20.0], "off:control": [10.0, 10.0]}
    order = []

    async def answered(url, conversations, concurrency, speculation, max_tokens, interval_s):
        mode, number = url
        order.append(mode)
        results = [
            {"tokens": 20, "seconds": 1.0, "ttft_s": 0.1, "itl_s": 0.01, "text": prompt}
            for prompt in conversations
        ]
        return results, 20 * len(conversations) / rates[mode][number]

    def counters(url):
        return {"requests_sent": len(order)}  # one more across each mode's round

    monkeypatch.setattr(http_categories, "run_requests", answered)
    monkeypatch.setattr(http_categories, "engine_counters", counters)

    class Urls(dict):
        def __getitem__(self, mode):  # a mode's server, and which round it answers
            return (mode, order.count(mode))

    row, results = http_categories.run_modes(Urls(), [["a"], ["b"]], 1, 16, shift=0)
    assert order == ["off", "auto", "off:control", "auto", "off:control", "off"]
    assert row["rounds"] == [
        {"auto_over_off": 1.5, "control_over_off": 1.0},
        {"auto_over_off": 1.0, "control_over_off": 0.5},
    ]
    # Pooled: 40 tokens in 2 + 1 s (off), 40 in 1.33 + 1 s (auto).
    assert row["off"]["tokens_per_s"] == pytest.approx(40 / 3, abs=0.01)
    assert row["auto_over_off"] == pytest.approx((40 / (20 / 15 + 1)) / (40 / 3), abs=1e-3)
    assert row["off"]["requests"] == 2 and row["identical"] and len(results["auto"]) == 2
    assert row["auto"]["engine"] == {"requests_sent": 2}
    # At fixed arrivals a round reads its requests' own seconds (all 1 s here), not the wall's.
    order.clear()
    row, _ = http_categories.run_modes(Urls(), [["a"]], 1, 16, shift=0, interval_s=0.5)
    assert row["rounds"] == [{"auto_over_off": 1.0, "control_over_off": 1.0}]
    assert "3 rounds of new prompts" in http_categories.settings_line({"repeats": 3})
    # The servers take turns a wave at a time: every chat on its own at C=1, the round at C=8.
    rounds = [["a", "b"], ["c", "d"]]
    assert http_categories.waves(rounds, 1) == [["a"], ["b"], ["c"], ["d"]]
    assert http_categories.waves(rounds, 8) == rounds
    assert "rounds" not in http_categories.settings_line({})


def test_distinct_prompts_never_repeat_and_say_when_they_run_out():
    from benchmarks.workloads import _EXTRA_INSTRUCTIONS, distinct_prompts

    prompts = distinct_prompts(("creative", "code_edit"), 40, seed=1)
    assert len({repr(prompt) for prompt in prompts}) == 40
    assert prompts == distinct_prompts(("creative", "code_edit"), 40, seed=1)
    # Past the creative generator's 64, earlier prompts come back with an instruction added;
    # the first ones stay what a smaller request gets.
    many = distinct_prompts(("creative",), 110, seed=3)
    assert len({repr(prompt) for prompt in many}) == 110
    assert many[:46] == distinct_prompts(("creative",), 46, seed=3)
    assert many[64][-1]["content"] == f"{many[0][-1]['content']} {_EXTRA_INSTRUCTIONS[0]}"
    with pytest.raises(ValueError, match="different conversations"):
        distinct_prompts(("creative",), 1000)


def test_readme_results_are_rendered_from_the_committed_result_files():
    """A table in docs/results.md, and the README's headline, are exactly what benchmarks.report
    makes of the committed JSON, so no number there can drift from (or be typed without) the
    run that produced it."""
    from benchmarks import report

    tables = report.readme_tables()
    expected = set(report.BLOCKS)
    assert set(tables) == expected, "every suite has committed results"
    for path, (current, rendered) in report.rendered_documents().items():
        assert rendered == current, f"{path.name}: run python -m benchmarks.report"


def test_render_readme_replaces_only_the_marked_blocks_and_refuses_a_missing_one():
    from benchmarks.report import render_readme

    readme = "intro\n<!-- results:pool -->\nold | table\n<!-- /results:pool -->\noutro\n"
    assert (
        render_readme(readme, {"pool": "new"})
        == "intro\n<!-- results:pool -->\nnew\n<!-- /results:pool -->\noutro\n"
    )
    with pytest.raises(ValueError, match="results:http"):
        render_readme(readme, {"http": "table"})


def test_compare_flags_ratios_outside_the_noise_band():
    from benchmarks.report import NOISE, compare

    full = {"a": 2.0, "b": 1.0, "only_full": 3.0}
    quick = {"a": 2.0 * (1 + NOISE / 2), "b": 1.0 * (1 + 2 * NOISE), "only_quick": 1.0}
    lines, num_outside = compare(full, quick)
    assert num_outside == 1
    assert len(lines) == 2 and "outside" in lines[1] and "outside" not in lines[0]


@pytest.mark.parametrize("suite", SUITES)
def test_committed_results_carry_provenance_and_plot(suite):
    from benchmarks import report

    payload = report.load(suite)
    assert payload is not None, f"benchmarks/results/{report.result_path(suite).name} is missing"
    assert payload["benchmark"] == suite
    for key in (
        "command",
        "commit",
        "date_utc",
        "machine",
        "processor",
        "cpu_threads",
        "torch",
        "model",
        "dtype",
    ):
        assert payload["meta"].get(key), f"{suite} result has no {key}"
    assert payload["meta"]["command"].startswith(f"python -m benchmarks.{suite}")
    module = report.suite_module(suite)
    ratios = module.ratios(payload)
    assert ratios and all(value > 0 for value in ratios.values())
    assert report.compare(ratios, ratios)[1] == 0
    figure = module.plot(payload)
    try:
        assert figure.axes and all(axis.lines or axis.patches for axis in figure.axes)
    finally:
        import matplotlib.pyplot as plt

        plt.close(figure)


def test_a_tree_draft_keeps_the_deepest_node_on_the_models_path():
    from benchmarks.replay import TreeDraft, accepted_prefix

    tree = TreeDraft(frozenset({(1,), (1, 2), (1, 3), (1, 3, 4)}))
    assert accepted_prefix(tree, [1, 3, 4, 5]) == 3
    assert accepted_prefix(tree, [1, 2, 9]) == 2
    assert accepted_prefix(tree, [7, 1]) == 0
    assert accepted_prefix([1, 3, 5], [1, 3, 4]) == 2  # a path: its leading tokens


def test_suffix_tree_holds_every_continuation_of_the_match_and_the_path_draft():
    from benchmarks.replay import TREE_MAX_NODES, suffix_tree
    from nasd_core.speculation.suffix import SuffixIndex

    index = SuffixIndex()
    for sequence in ([5, 6, 7, 8, 9], [5, 6, 7, 1, 2], [5, 6, 7, 8, 3]):
        index.add_sequence(sequence)
    context = [4, 5, 6, 7]
    tree, match_length = suffix_tree(index, context, max_tokens=16, exclude=-1, max_spec_factor=1.0)
    assert match_length == 3
    # Depth up to the match length; both continuations after 7 (8 twice, 1 once), and theirs.
    assert tree.nodes == {(8,), (1,), (8, 9), (8, 3), (1, 2)}
    path = index.draft(context, 16, max_spec_factor=1.0).tokens
    assert all(tuple(path[: depth + 1]) in tree.nodes for depth in range(len(path)))
    shallow, _ = suffix_tree(index, context, max_tokens=1, exclude=-1, max_spec_factor=1.0)
    assert shallow.nodes == {(8,), (1,)}
    index.add_sequence([5, 6, 7, *range(100, 100 + 2 * TREE_MAX_NODES)])
    wide, _ = suffix_tree(index, context, max_tokens=64, exclude=-1, max_spec_factor=30.0)
    assert len(wide) == TREE_MAX_NODES


def test_agent_cluster_reads_each_turns_reuse_against_the_history_before_it():
    from benchmarks.agent_cluster import per_turn

    def record(turn: int, prompt: int, cached: int, seconds: float) -> dict:
        return {
            "turn": turn,
            "seconds": seconds,
            "prompt_tokens": prompt,
            "cached_tokens": cached,
            "completion_tokens": 10,
            "tokens_per_step": 2.0,
        }

    runs = [
        [record(0, 100, 0, 1.0), record(1, 200, 110, 2.0)],
        [record(0, 50, 16, 3.0), record(1, 150, 30, 4.0)],
    ]
    first, second = per_turn(runs, 2)
    assert first["history_reused"] is None and first["cached_share"] == round(16 / 150, 3)
    assert second["computed_prompt_tokens"] == 350 - 140
    assert second["history_reused"] == round(140 / (110 + 60), 3)  # the previous prompts and answers
    assert (second["latency_p50_s"], second["tokens_per_step"]) == (3.0, 2.0)
