"""How much speculation can speed a decode step on this host, from measured steps (issue 51).

A step of R rows x W positions reads every weight once and multiplies every position by it. At
one row the read dominates, so drafted positions come almost free; at eight rows on a CPU the
int8 multiply-adds dominate, and each drafted position costs a good share of a row's step. This
times steps of 1 and 8 rows x 1..8 positions a row (one thread, as a server decodes; interleaved)
at two cached lengths, and computes from them, for a per-draft acceptance rate a (each draft kept
with probability a when the ones before it were), the best step speedup over plain decoding that
any draft length k gives, every row drafting k:

    s(a) = max over k of  E(k, a) * T(R x 1) / T(R x (k + 1)),   E(k, a) = (1 - a^(k + 1)) / (1 - a)

the tokens a row gains per step over the step's price. A policy choosing k per row and step moves
between these; none beats the best k for the rows' real acceptance. Prompt chunks take the same
time with and without drafts, so with a share p of the engine's time in them, a whole run's
`auto` / `off` is at most 1 / (p + (1 - p) / s) (Amdahl).

    python -m benchmarks.spec_ceiling          # prints the tables, writes results/spec_ceiling.json
"""

from __future__ import annotations

import argparse
from functools import partial

import torch

from benchmarks.common import fastest_interleaved_ms, run_metadata, write_result
from benchmarks.gguf_step import repeated_step
from nasd_core import native
from nasd_core.config import ModelConfig
from nasd_core.loader import load_model
from nasd_core.speculation.calibration import filled_runner

ROWS = (1, 8)
WIDTHS = tuple(range(1, 9))
CONTEXTS = (256, 1024)
ACCEPTANCE = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
# Shares of the engine's time in prompt chunks: none, and 0.55, what eight mixed chats at a time
# spent there in process (docs/results.md, "Where the time goes at eight requests").
PREFILL_SHARES = (0.0, 0.55)


def expected_tokens(drafts: int, acceptance: float) -> float:
    """Tokens a row gains from a step verifying ``drafts`` drafts: the accepted run plus one."""
    return sum(acceptance**i for i in range(drafts + 1))


def best_speedup(step_ms: dict[int, float], acceptance: float) -> tuple[float, int]:
    """The best step speedup over plain decoding and the draft length that gives it (0: none)."""
    plain = step_ms[1]
    return max(
        (expected_tokens(width - 1, acceptance) * plain / ms, width - 1) for width, ms in step_ms.items()
    )


def run_ceiling(step_speedup: float, prefill_share: float) -> float:
    """A run's ``auto`` / ``off`` when only its decode steps speed up, by ``step_speedup``."""
    return 1.0 / (prefill_share + (1.0 - prefill_share) / step_speedup)


@torch.inference_mode()
def step_cells(repeats: int) -> dict[str, dict[int, float]]:
    """ms of one step per (cached length, rows), by positions a row; one thread."""
    model, _ = load_model(None, ModelConfig(dtype="gguf"))
    torch.set_num_threads(1)
    cells: dict[str, dict[int, float]] = {}
    for context in CONTEXTS:
        runner = filled_runner(model, max(ROWS), context, max(WIDTHS))
        for rows in ROWS:
            runs = {str(width): repeated_step(runner, rows, width, context) for width in WIDTHS}
            for run in runs.values():
                run()
            timings = fastest_interleaved_ms(
                {width: partial(lambda r: r, run) for width, run in runs.items()}, repeats, 5
            )
            cells[f"{context} cached, {rows} rows"] = {int(width): ms for width, ms in timings.items()}
            print("step", context, rows, timings, flush=True)
    return cells


def ceilings(cells: dict[str, dict[int, float]]) -> dict[str, dict[str, dict[str, float]]]:
    """Per cell and acceptance rate: the best step speedup, its draft length, and the run ceilings."""
    table: dict[str, dict[str, dict[str, float]]] = {}
    for name, step_ms in cells.items():
        table[name] = {}
        for acceptance in ACCEPTANCE:
            speedup, drafts = best_speedup(step_ms, acceptance)
            entry = {"step_speedup": round(speedup, 3), "drafts": drafts}
            entry |= {f"run_p{share}": round(run_ceiling(speedup, share), 3) for share in PREFILL_SHARES}
            table[name][str(acceptance)] = entry
    return table


def markdown_tables(payload: dict) -> str:
    cells, table = payload["step_ms"], payload["ceiling"]
    lines = ["", "| step (ms), 1 thread | " + " | ".join(f"{w} pos" for w in WIDTHS) + " |"]
    lines.append("|---|" + "---|" * len(WIDTHS))
    lines += [
        f"| {name} | " + " | ".join(f"{row[w]:.1f}" for w in WIDTHS) + " |" for name, row in cells.items()
    ]
    header = " | ".join(f"a = {a}" for a in ACCEPTANCE)
    lines += ["", f"| best step speedup (drafts) | {header} |", "|---|" + "---|" * len(ACCEPTANCE)]
    for name, row in table.items():
        values = [row[str(a)] for a in ACCEPTANCE]
        lines.append(
            f"| {name} | " + " | ".join(f"{v['step_speedup']:.2f}x ({v['drafts']})" for v in values) + " |"
        )
    for share in PREFILL_SHARES[1:]:
        lines += [
            "",
            f"| run ceiling, prefill share {share} | {header} |",
            "|---|" + "---|" * len(ACCEPTANCE),
        ]
        for name, row in table.items():
            lines.append(
                f"| {name} | " + " | ".join(f"{row[str(a)][f'run_p{share}']:.2f}x" for a in ACCEPTANCE) + " |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    if not native.load():
        raise SystemExit("the C++ kernels did not build here")
    cells = step_cells(args.repeats)
    payload = {
        "benchmark": "spec_ceiling",
        "meta": run_metadata(None, "gguf", "benchmarks.spec_ceiling"),
        "q8_path": torch.ops.nasd.quant_linear_q8_path(),
        "step_ms": cells,
        "ceiling": ceilings(cells),
    }
    print(markdown_tables(payload))
    print(f"results: {write_result('spec_ceiling', payload)}")


if __name__ == "__main__":
    main()
