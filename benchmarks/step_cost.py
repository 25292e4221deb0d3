"""Cost of one verification step by batch shape (rows x positions per row), per dtype.

This is the surface the ``auto`` policy weighs drafts against. float32 is timed twice, with
transformers' stock CPU kernels and with the CPU fast path ``load_model`` applies by default
(``nasd_core/layers/cpu_kernels.py``), in the same run.

On another device (a GPU) or for a larger architecture with random weights, one model is
timed and the run also checks the policy's cost model and the attention layout:
- the probe's surface (what ``calibrate`` gives the policy), then steps of widths the probe
  never timed, each beside the step-time model's estimate for it (the interpolation error the
  policy prices drafts with);
- decode and 5-position steps with every row attended by its own SDPA call and with the rows
  padded into one call per layer (``ModelRunner.batch_attention``), at two context lengths;
- with ``--step-graphs``, the probe's surface again on fixed-shape steps, replayed from CUDA
  graphs on a GPU (``nasd_core/runner/step_graphs.py``), for each ``--graph-attention`` layout
  (paged through the block tables, the default; gathered per context bucket);
- beside them, transformers' own decode step (a static cache, one position per row) captured
  as one CUDA graph, and the time to read the weights once at the device's copy bandwidth:
  the floor no decode step goes under.

python -m benchmarks.step_cost                      # float32 stock/fast and bfloat16, rows 1..32
python -m benchmarks.step_cost --device cuda --dtype bfloat16 --arch qwen2-1.5b --rows 1 4 16 64 --step-graphs
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks.common import publish_run, run_metadata, suite_parser
from nasd_core.config import ModelConfig
from nasd_core.layers.compiled_layers import compile_layers
from nasd_core.loader import load_model
from nasd_core.loader.random_weights import ARCHITECTURES, random_model
from nasd_core.runner.model_runner import ModelRunner, StepRow
from nasd_core.runner.step_graphs import POSITION_BUCKETS, bucket
from nasd_core.speculation.calibration import (
    PROBE_POSITIONS,
    filled_runner,
    measure_step_times,
    probe_row,
    time_step,
)
from nasd_core.speculation.step_time import StepTimeModel

# Model set-ups timed, by the name the results use.
VARIANTS = {
    "float32": ModelConfig(dtype="float32"),
    "float32_stock_kernels": ModelConfig(dtype="float32", cpu_fast_path=False),
    "bfloat16": ModelConfig(dtype="bfloat16"),
}


# Widths the probe does not time (PROBE_POSITIONS has 1-6, 9, 17): the cost model interpolates them.
HELD_OUT_WIDTHS = (7, 12)
LAYOUT_WIDTHS = (1, 5)
LAYOUT_CONTEXTS = (256, 1024)
PROMPT_CHUNK = 512


def fastest_ms(runner: ModelRunner, widths: list[int], context_length: int, repeats: int) -> float:
    return round(1000 * min(time_step(runner, widths, context_length) for _ in range(repeats)), 2)


def held_out(model, step_time: StepTimeModel, rows: list[int], repeats: int) -> dict:
    """Measured and estimated ms of steps at ``HELD_OUT_WIDTHS`` per row, by rows."""
    context_length = 256  # the probe's
    runner = filled_runner(model, max(rows), context_length, max(HELD_OUT_WIDTHS), compiled_layers=False)
    result: dict[int, dict[int, dict[str, float]]] = {}
    for num_rows in rows:
        for width in HELD_OUT_WIDTHS:
            measured = fastest_ms(runner, [width] * num_rows, context_length, repeats)
            estimated = round(1000 * step_time.estimate(num_rows, num_rows * width), 2)
            result.setdefault(num_rows, {})[width] = {"measured_ms": measured, "estimated_ms": estimated}
    del runner
    return result


def attention_layouts(model, rows: list[int], repeats: int) -> dict:
    """ms of steps with rows attended one call each (``per_row``) and in one padded call
    (``batched``), by context length, rows and width."""
    result: dict[int, dict[int, dict[int, dict[str, float]]]] = {}
    for context_length in LAYOUT_CONTEXTS:
        runner = filled_runner(model, max(rows), context_length, max(LAYOUT_WIDTHS), compiled_layers=False)
        for num_rows in rows:
            for width in LAYOUT_WIDTHS:
                cell = {}
                for layout, batched in (("per_row", False), ("batched", True)):
                    runner.batch_attention = batched
                    cell[layout] = fastest_ms(runner, [width] * num_rows, context_length, repeats)
                result.setdefault(context_length, {}).setdefault(num_rows, {})[width] = cell
        del runner
    return result


# Cached positions per row of the transformers baseline's decode step (the probe's context).
BASELINE_CONTEXT = 256
TIMED_REPLAYS = 10


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def transformers_step_ms(model, rows: int, repeats: int, graph: bool = True) -> float:
    """Milliseconds of transformers' own decode step over ``rows`` rows of ``BASELINE_CONTEXT``
    cached positions (its static cache, one position per row), replayed from one CUDA graph
    (run eagerly where ``graph`` is False: on a CPU)."""
    from transformers import StaticCache

    device = model.device
    # The cache's write position lives on the device and every replay advances it: room for all.
    room = BASELINE_CONTEXT + 4 + repeats * TIMED_REPLAYS
    cache = StaticCache(config=model.config, max_cache_len=room)
    prompt = torch.full((rows, BASELINE_CONTEXT), 7, dtype=torch.long, device=device)
    model(input_ids=prompt, cache=cache, use_cache=True)
    token = torch.full((rows, 1), 7, dtype=torch.long, device=device)
    position = torch.full((1, 1), BASELINE_CONTEXT, dtype=torch.long, device=device)

    def step() -> torch.Tensor:
        return model(input_ids=token, position_ids=position, cache=cache, use_cache=True).logits

    return round(1000 * replay_seconds(step, device, repeats, graph), 3)


def replay_seconds(step, device: torch.device, repeats: int, graph: bool = True) -> float:
    """Fastest seconds per run of ``step`` (``TIMED_REPLAYS`` runs, ``repeats`` times), replayed
    from one CUDA graph captured after two warm-up runs (run eagerly where ``graph`` is False)."""
    run = step
    if graph:
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                step()
        torch.cuda.current_stream(device).wait_stream(stream)
        captured = torch.cuda.CUDAGraph()
        with torch.cuda.graph(captured):
            step()
        run = captured.replay
    fastest = float("inf")
    for _ in range(repeats):
        synchronize(device)
        started = time.perf_counter()
        for _ in range(TIMED_REPLAYS):
            run()
        synchronize(device)
        fastest = min(fastest, (time.perf_counter() - started) / TIMED_REPLAYS)
    return fastest


@torch.inference_mode()
def weights_read_ms(model, repeats: int) -> float:
    """Milliseconds to read the model's weights once at the device's copy bandwidth (a 1 GiB
    copy reads and writes each byte once)."""
    device = model.device
    source = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    fastest = float("inf")
    for _ in range(repeats + 1):
        synchronize(device)
        started = time.perf_counter()
        target.copy_(source)
        synchronize(device)
        fastest = min(fastest, time.perf_counter() - started)
    read_bytes_per_s = source.numel() / fastest  # a copy's read half
    weight_bytes = sum(parameter.numel() * parameter.element_size() for parameter in model.parameters())
    return round(1000 * weight_bytes / read_bytes_per_s / 2, 3)


def graphs_surface(model, args: argparse.Namespace, layout: str, compiled_layers: bool) -> dict:
    """ms of fixed-shape steps (replayed from CUDA graphs on a GPU), by rows and probe width."""
    graphs_time = measure_step_times(
        model,
        PROBE_POSITIONS,
        args.rows,
        repeats=args.repeats,
        step_graphs=True,
        graph_attention=layout,
        compiled_layers=compiled_layers,
    ).graph_step_times
    return {
        rows: {
            width: round(1000 * graphs_time.estimate(rows, bucket(width, POSITION_BUCKETS)), 1)
            for width in PROBE_POSITIONS
        }
        for rows in args.rows
    }


@torch.inference_mode()
def prompt_chunk_ms(model, repeats: int, compiled_layers: bool, step_graphs: bool = False) -> float:
    """ms of one ``PROMPT_CHUNK``-token prompt chunk after 256 cached positions, one position's
    logits: on the packed path, or in a prompt-chunk shape of the paged step graphs (captured
    on a GPU by its first run)."""
    context_length = 256
    runner = filled_runner(
        model,
        1,
        context_length,
        PROMPT_CHUNK,
        step_graphs=step_graphs,
        graph_attention="paged" if step_graphs else None,
        compiled_layers=compiled_layers,
    )
    step = [StepRow(probe_row(0), [7] * PROMPT_CHUNK, 1)]
    fastest = float("inf")
    for _ in range(repeats + 1):  # the first run compiles (and captures) for this length
        synchronize(model.device)
        started = time.perf_counter()
        runner.forward(step)[-1, 0].item()
        fastest = min(fastest, time.perf_counter() - started)
        runner.cache.set_length(probe_row(0), context_length)
    if step_graphs:
        assert runner.graphs is not None and runner.graphs.chunk_failure is None, runner.graphs.chunk_failure
        assert any(shape.num_positions == PROMPT_CHUNK for shape in runner.graphs.steps)
    return round(1000 * fastest, 2)


@torch.inference_mode()
def transformers_chunk_ms(model, repeats: int) -> float:
    """ms of transformers' own forward over a ``PROMPT_CHUNK``-token prompt (no cache, causal
    SDPA, the last position's logits), replayed from one CUDA graph."""
    device = model.device
    tokens = torch.full((1, PROMPT_CHUNK), 7, dtype=torch.long, device=device)

    def step() -> torch.Tensor:
        return model(input_ids=tokens, use_cache=False, logits_to_keep=1).logits

    return round(1000 * replay_seconds(step, device, repeats), 2)


def device_run(args: argparse.Namespace) -> None:
    """One model on ``args.device``: surface, held-out estimates, attention layouts."""
    if args.arch:
        model = random_model(args.arch, args.dtype, args.device)
    else:
        model, _ = load_model(config=ModelConfig(dtype=args.dtype, device=args.device))
    warm = filled_runner(model, 1, 16, 1, compiled_layers=False)
    for _ in range(3):  # first calls pay one-off costs (handles, kernel selection)
        time_step(warm, [1], 16)
    del warm
    step_time = measure_step_times(
        model, PROBE_POSITIONS, rows=args.rows, repeats=args.repeats, compiled_layers=False
    ).step_time
    graphs_surfaces = {}
    for layout in args.graph_attention if args.step_graphs else ():
        key = "step_graphs" if layout == "paged" else f"step_graphs_{layout}"
        graphs_surfaces[key] = graphs_surface(model, args, layout, compiled_layers=False)
    payload = {
        "benchmark": "step_cost",
        "meta": {
            **run_metadata(model, args.dtype, "benchmarks.step_cost"),
            "arch": args.arch or "embedded",
            "parameters": sum(parameter.numel() for parameter in model.parameters()),
        },
        "ms_by_rows_and_positions": {args.dtype: {rows: shape_ms(step_time, rows) for rows in args.rows}},
        "held_out": held_out(model, step_time, args.rows, args.repeats),
        "attention_layouts": attention_layouts(model, args.rows, args.repeats),
        "transformers_one_graph_ms": {
            rows: transformers_step_ms(model, rows, args.repeats, graph=model.device.type == "cuda")
            for rows in args.rows
        },
        "weights_read_ms": weights_read_ms(model, args.repeats),
    }
    payload.update(graphs_surfaces)
    if args.compiled_layers:  # last: compiling changes the model in place
        chunk = {"transformers_layers": prompt_chunk_ms(model, args.repeats, compiled_layers=False)}
        if model.device.type == "cuda":
            chunk["transformers_one_graph"] = transformers_chunk_ms(model, args.repeats)
        payload["compile_failure"] = compile_layers(model)
        chunk["compiled_layers"] = prompt_chunk_ms(model, args.repeats, compiled_layers=True)
        if args.step_graphs:
            chunk["chunk_graph"] = prompt_chunk_ms(
                model, args.repeats, compiled_layers=True, step_graphs=True
            )
        payload[f"prompt_chunk_{PROMPT_CHUNK}_ms"] = chunk
        if args.step_graphs:
            compiled = graphs_surface(model, args, "paged", compiled_layers=True)
            payload["step_graphs_compiled_layers"] = compiled
    name = f"step_cost_{args.device.split(':')[0]}_{args.arch or 'embedded'}"
    publish_run(name, payload, markdown_table)


CHUNK_COLUMNS = {
    "transformers_layers": "packed, transformers' layers",
    "transformers_one_graph": "transformers, one CUDA graph",
    "compiled_layers": "packed, compiled layers",
    "chunk_graph": "chunk graph, compiled layers",
}


def markdown_table(payload: dict) -> str:
    """A device run's tables: the probe's surface; held-out widths, measured and as the cost
    model estimates them; decode and 5-position steps in the two attention layouts."""
    ((dtype, surface),) = payload["ms_by_rows_and_positions"].items()
    widths = list(next(iter(surface.values())))
    lines = [
        f"| rows \\ positions per row ({dtype}, ms) | " + " | ".join(widths) + " |",
        "|---|" + "---|" * len(widths),
        *(
            f"| {rows} | " + " | ".join(f"{ms:.1f}" for ms in row.values()) + " |"
            for rows, row in surface.items()
        ),
        "",
        "| rows | "
        + " | ".join(f"{width} per row: measured / estimated ms" for width in HELD_OUT_WIDTHS)
        + " |",
        "|---|" + "---|" * len(HELD_OUT_WIDTHS),
    ]
    for rows, cells in payload["held_out"].items():
        lines.append(
            f"| {rows} | "
            + " | ".join(f"{cell['measured_ms']:.1f} / {cell['estimated_ms']:.1f}" for cell in cells.values())
            + " |"
        )
    for key, what in (
        ("step_graphs", "steps replayed from CUDA graphs"),
        ("step_graphs_compiled_layers", "the same, compiled layers"),
    ):
        if key in payload:
            lines += [
                "",
                f"| rows \\ positions per row, {what} ({dtype}, ms) | " + " | ".join(widths) + " |",
                "|---|" + "---|" * len(widths),
                *(
                    f"| {rows} | " + " | ".join(f"{ms:.1f}" for ms in row.values()) + " |"
                    for rows, row in payload[key].items()
                ),
            ]
    chunk = payload.get(f"prompt_chunk_{PROMPT_CHUNK}_ms")
    if chunk:
        lines += [
            "",
            f"| a {PROMPT_CHUNK}-token prompt chunk (ms) | "
            + " | ".join(CHUNK_COLUMNS.get(name, name) for name in chunk)
            + " |",
            "|---|" + "---|" * len(chunk),
            "| after 256 cached positions"
            + (" (transformers' graph: no cache)" if "transformers_one_graph" in chunk else "")
            + " | "
            + " | ".join(f"{ms:.1f}" for ms in chunk.values())
            + " |",
        ]
    if "transformers_one_graph_ms" in payload:
        baseline = payload["transformers_one_graph_ms"]
        lines += [
            "",
            f"| rows | transformers' decode step, one CUDA graph ({dtype}, ms) | weights read once (ms) |",
            "|---|---|---|",
            *(f"| {rows} | {ms:.2f} | {payload['weights_read_ms']:.2f} |" for rows, ms in baseline.items()),
        ]
    contexts = list(payload["attention_layouts"])
    header = [f"ctx {context}, {width} per row" for context in contexts for width in LAYOUT_WIDTHS]
    lines += ["", "| rows | " + " | ".join(f"{name}: per-row / batched ms" for name in header) + " |"]
    lines.append("|---|" + "---|" * len(header))
    for rows in payload["attention_layouts"][contexts[0]]:
        cells = [
            payload["attention_layouts"][context][rows][str(width)]
            for context in contexts
            for width in LAYOUT_WIDTHS
        ]
        pairs = (f"{cell['per_row']:.1f} / {cell['batched']:.1f}" for cell in cells)
        lines.append(f"| {rows} | " + " | ".join(pairs) + " |")
    return "\n".join(lines)


def shape_ms(step_time: StepTimeModel, num_rows: int) -> dict[int, float]:
    """Milliseconds of a step of ``num_rows`` rows by positions per row (fastest of the repeats)."""
    return {
        width: round(1000 * step_time.measured(num_rows, num_rows * width), 1) for width in PROBE_POSITIONS
    }


def main() -> None:
    parser = suite_parser(__doc__)
    parser.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--rows", nargs="*", type=int, default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu", help="torch device (not cpu: one model, device_run)")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"], help="with --device")
    parser.add_argument("--arch", choices=list(ARCHITECTURES), default=None, help="random weights of this")
    parser.add_argument(
        "--step-graphs",
        action="store_true",
        help="with --device: also time the surface on fixed-shape steps (replayed from CUDA graphs on a GPU)",
    )
    parser.add_argument(
        "--compiled-layers",
        action="store_true",
        help="with --device: last, compile the layers (RunnerConfig.compiled_layers) and time a "
        f"{PROMPT_CHUNK}-token prompt chunk before and after, and the graphs' surface after",
    )
    parser.add_argument(
        "--graph-attention",
        nargs="+",
        choices=["paged", "gathered"],
        default=["paged"],
        help="with --step-graphs: fixed-shape attention layouts to time (RunnerConfig.graph_attention)",
    )
    args = parser.parse_args()
    if args.device != "cpu" or args.arch:
        device_run(args)
        return
    surfaces: dict[str, dict[int, dict[int, float]]] = {}
    meta: dict[str, object] = {}
    for variant in args.variants:
        model, _ = load_model(config=VARIANTS[variant])
        step_time = measure_step_times(model, PROBE_POSITIONS, rows=args.rows, repeats=args.repeats).step_time
        surfaces[variant] = {rows: shape_ms(step_time, rows) for rows in args.rows}
        meta = run_metadata(model, VARIANTS[variant].dtype, "benchmarks.step_cost")
        for rows, by_positions in surfaces[variant].items():
            print(variant, f"{rows} rows, ms by positions per row:", by_positions)
        del model
    meta["dtype"] = sorted({VARIANTS[variant].dtype for variant in args.variants})
    publish_run("step_cost", {"benchmark": "step_cost", "meta": meta, "ms_by_rows_and_positions": surfaces})


if __name__ == "__main__":
    main()
