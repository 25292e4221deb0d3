"""Benchmark results into docs/results.md, the README's headline and plots; a quick run held
against the full one.

Each suite (``benchmarks/<suite>.py``; ``benchmarks/common.py`` says what a suite is) writes
``results/<stem>.json`` and knows how to show it (``markdown_table``, ``plot``, ``ratios``).
Tables sit between ``<!-- results:<name> -->`` and ``<!-- /results:<name> -->`` in
docs/results.md (the README's headline block too) and are only ever written from those files,
so a number there is always one a committed run produced.

    python -m benchmarks.report             # rewrite the tables, the headline and the plots
    python -m benchmarks.report --check     # exit 1 where a document differs from the results
    python -m benchmarks.report --compare   # each *_quick.json ratio beside its full run's
"""

from __future__ import annotations

import argparse
import importlib
import json
import re
import sys
from pathlib import Path

from benchmarks.common import RESULTS_DIR, save_figure

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
RESULTS_DOC = ROOT / "docs" / "results.md"
# docs/results.md's tables: block -> (result file stem, suite, the suite's table function). Each
# has its plot where the suite has one.
BLOCKS = {
    "vs_llamacpp": ("vs_llamacpp_gguf", "vs_llamacpp", "markdown_table"),
    "http_categories": ("http_categories_gguf", "http_categories", "markdown_table"),
    "lockstep": ("lockstep_gguf", "lockstep", "markdown_table"),
    "single_stream": ("single_stream_float32", "single_stream", "markdown_table"),
    "concurrency": ("concurrency_float32", "concurrency", "markdown_table"),
    "prefix_cache": ("prefix_cache_float32", "prefix_cache", "markdown_table"),
    "agent_cluster": ("agent_cluster_gguf", "agent_cluster", "markdown_table"),
    "replay": ("replay_float32", "replay", "markdown_table"),
    "pool": ("pool_float32", "pool", "markdown_table"),
    "structured": ("structured_float32", "structured", "markdown_table"),
    "replica_kill": ("replica_kill_float32", "replica_kill", "markdown_table"),
    # Runs on a lent GPU (benchmarks/gpu_session.sh). The H200's latest session (cb7c224); its
    # earlier sessions' tables (a3fe434, 5ba89c1) left with their files when it superseded them.
    "gpu_step_cost_host": ("step_cost_cuda_qwen2-1.5b_h200_host", "step_cost", "markdown_table"),
    "gpu_single_stream_host": ("concurrency_cuda_bfloat16_h200_host", "concurrency", "runs_table"),
    "gpu_step_cost": ("step_cost_cuda_qwen2-1.5b", "step_cost", "markdown_table"),
    "gpu_concurrency": ("concurrency_cuda_bfloat16", "concurrency", "runs_table"),
    "gpu_single_stream": ("single_stream_cuda_bfloat16", "single_stream", "markdown_table"),
}
# What ``python -m benchmarks`` runs, one suite after the other (make bench; make bench-quick runs
# each one's --quick, its ratios held against the full run's).
SUITES = ("single_stream", "concurrency", "prefix_cache", "pool", "http_categories", "replay")
# The README's headline: (what, result file stem, suite, ratio key, docs/results.md anchor).
HEADLINE = (
    (
        "Laptop (`make serve`'s model), 1 client: engine plain decoding / llama.cpp plain, same GGUF",
        "vs_llamacpp_gguf",
        "vs_llamacpp",
        "nasd_gguf_off/all",
        "the-laptop-path-the-engine-on-the-gguf-blocks-against-llamacpp",
    ),
    (
        "Laptop, 1 client: engine `auto` / llama.cpp plain, same GGUF",
        "vs_llamacpp_gguf",
        "vs_llamacpp",
        "nasd_gguf_auto/all",
        "the-laptop-path-the-engine-on-the-gguf-blocks-against-llamacpp",
    ),
    (
        "Laptop through the server (HTTP), 1 client, every category: `auto` / plain decoding",
        "http_categories_gguf",
        "http_categories",
        "C=1",
        "auto-against-plain-decoding-through-http-by-category",
    ),
    (
        "Laptop through the server (HTTP), 8 clients, mixed categories: `auto` / plain decoding",
        "http_categories_gguf",
        "http_categories",
        "mixed",
        "auto-against-plain-decoding-through-http-by-category",
    ),
    (
        "Multi-turn chats, 1 client: tokens/s with the prefix cache / without",
        "prefix_cache_float32",
        "prefix_cache",
        "C1/tokens_per_s",
        "multi-turn-chats-the-prefix-cache",
    ),
    (
        "Agent tool calls (forced, three turns), 1 client: constrained `auto` / constrained plain",
        "structured_float32",
        "structured",
        "agent tool calls/C=1",
        "structured-output-and-tools",
    ),
    (
        "Engine, repetitive requests, 1 client: `auto` / plain (no CUDA graphs)",
        "concurrency_cuda_bfloat16",
        "concurrency",
        "repetitive/C=1/auto",
        "on-a-gpu-one-h100-bfloat16",
    ),
    (
        "Single stream, code edit: `auto` / transformers' `generate` (no CUDA graphs)",
        "single_stream_cuda_bfloat16",
        "single_stream",
        "code_edit/nasd_auto",
        "on-a-gpu-one-h100-bfloat16",
    ),
)
# A quick run uses fewer prompts and tokens: a ratio within this factor of the full run's is
# taken as reproduced (cells of the full run alone vary by about ±15% on a 2-core VM).
NOISE = 0.25


def result_path(suite: str, quick: bool = False) -> Path:
    """The result file of a suite's run (its block's), or of its quick run."""
    return RESULTS_DIR / f"{BLOCKS[suite][0]}{'_quick' if quick else ''}.json"


def load(suite: str, quick: bool = False) -> dict | None:
    path = result_path(suite, quick)
    return json.loads(path.read_text()) if path.exists() else None


def suite_module(suite: str):
    return importlib.import_module(f"benchmarks.{suite}")


def render_readme(readme: str, tables: dict[str, str]) -> str:
    """``readme`` with each suite's marked block replaced by its table (and the command that
    produced it); a suite whose markers are missing is an error, not a silent skip."""
    for suite, table in tables.items():
        pattern = re.compile(rf"(<!-- results:{suite} -->\n).*?(<!-- /results:{suite} -->)", re.DOTALL)
        if not pattern.search(readme):
            raise ValueError(f"README has no <!-- results:{suite} --> ... <!-- /results:{suite} --> block")
        readme = pattern.sub(
            lambda match, table=table: match.group(1) + table + "\n" + match.group(2), readme
        )
    return readme


def footer(meta: dict, path: Path) -> str:
    """Where a table came from: command, commit, date, machine (a GPU run names its device and
    host), torch, dtype and the result file."""
    machine = f"{meta['processor']} ({meta['cpu_threads']} threads)"
    if meta.get("device", "cpu") != "cpu":
        machine = f"{meta['device']} (host: {meta['processor']}, {meta['cpu_threads']} threads)"
    return (
        f"\n\n<sub>`{meta['command']}` at commit {meta['commit']}, {meta['date_utc']} UTC, "
        f"{machine}, torch {meta['torch']}, {meta['dtype']}; data: `benchmarks/results/{path.name}`</sub>"
    )


def cpu_device(meta: dict) -> str:
    """A CPU result's host: its processor, instruction set (where the run recorded it) and threads."""
    isa = f", {meta['isa']}" if meta.get("isa") else ""
    return f"{meta.get('processor') or 'CPU'}{isa}, {meta['cpu_threads']} threads"


def headline_table() -> str:
    """The README's headline: the figures of ``HEADLINE``, each with its device, date and the
    full table it comes from."""
    lines = ["| measured | ratio | device | date |", "|---|---|---|---|"]
    for what, stem, suite, key, anchor in HEADLINE:
        payload = json.loads((RESULTS_DIR / f"{stem}.json").read_text())
        ratio = suite_module(suite).ratios(payload)[key]
        meta = payload["meta"]
        device = meta["device"] if meta.get("device", "cpu") != "cpu" else cpu_device(meta)
        link = f"[{what}](docs/results.md#{anchor})"
        lines.append(f"| {link} | **{ratio:.2f}x** | {device} | {meta['date_utc'][:10]} |")
    lines.append("")
    lines.append(
        "<sub>Written by `python -m benchmarks.report` from `benchmarks/results/`; each linked table "
        "names its command.</sub>"
    )
    return "\n".join(lines)


def readme_tables() -> dict[str, str]:
    """Each block's table and where it came from, for the blocks whose result file exists."""
    tables = {}
    for name, (stem, suite, table) in BLOCKS.items():
        path = RESULTS_DIR / f"{stem}.json"
        if path.exists():
            payload = json.loads(path.read_text())
            tables[name] = getattr(suite_module(suite), table)(payload) + footer(payload["meta"], path)
    return tables


def rendered_documents() -> dict[Path, tuple[str, str]]:
    """Each document with its current text and its text rendered from the results."""
    tables = readme_tables()
    readme = README.read_text()
    results = RESULTS_DOC.read_text()
    return {
        README: (readme, render_readme(readme, {"headline": headline_table()})),
        RESULTS_DOC: (results, render_readme(results, tables)),
    }


def compare(full: dict[str, float], quick: dict[str, float]) -> tuple[list[str], int]:
    """Lines of a quick-vs-full table over the keys both runs have; and how many ratios fall
    outside ``NOISE``."""
    lines, num_outside = [], 0
    for key in sorted(full.keys() & quick.keys()):
        factor = quick[key] / full[key] if full[key] else float("inf")
        outside = abs(factor - 1) > NOISE
        num_outside += outside
        lines.append(
            f"  {key:<48} full {full[key]:6.2f}x  quick {quick[key]:6.2f}x"
            + ("  <-- outside" if outside else "")
        )
    return lines, num_outside


def print_comparison() -> int:
    """Print every suite's quick ratios beside the full run's; the number outside the noise."""
    total_outside = 0
    for suite in SUITES:
        full, quick = load(suite), load(suite, quick=True)
        if full is None or quick is None:
            print(f"{suite}: {'full' if full is None else 'quick'} results missing, nothing to compare")
            continue
        ratios = suite_module(suite).ratios
        lines, num_outside = compare(ratios(full, like=quick), ratios(quick))
        total_outside += num_outside
        print(f"{suite}: {len(lines) - num_outside}/{len(lines)} ratios within ±{NOISE:.0%} of the full run")
        print("\n".join(lines))
    return total_outside


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="exit 1 if the README's tables are stale")
    mode.add_argument("--compare", action="store_true", help="quick-run ratios beside the full run's")
    args = parser.parse_args()
    if args.compare:
        print_comparison()
        return
    documents = rendered_documents()
    stale = [path.name for path, (current, updated) in documents.items() if current != updated]
    if args.check:
        if stale:
            sys.exit(f"{', '.join(stale)} differ from benchmarks/results: run python -m benchmarks.report")
        print("README and docs/results.md match benchmarks/results")
        return
    for path, (_, updated) in documents.items():
        path.write_text(updated)
    for stem, suite, _ in BLOCKS.values():  # the CPU runs' plots; a GPU session's tables stand alone
        path = RESULTS_DIR / f"{stem}.json"
        if not (hasattr(suite_module(suite), "plot") and path.exists()):
            continue
        payload = json.loads(path.read_text())
        if payload["meta"].get("device", "cpu") == "cpu":
            print(f"plot: {save_figure(suite_module(suite).plot(payload), stem)}")
    print(f"README headline and docs/results.md rewritten from {RESULTS_DIR}")


if __name__ == "__main__":
    main()
