"""Loading a GGUF file: time, peak memory and cache size, into an empty cache and from it.

``dtype="gguf"`` builds the model from the file's own tensors and caches only its config and
tokenizer; ``dtype="float32"`` converts the whole file to float32 once (transformers' GGUF
loader) and loads that. Each load runs in a fresh Python process, which reports its own peak
resident memory (``VmHWM``, the imports included).

    python -m benchmarks.first_load                      # the embedded model
    python -m benchmarks.first_load --model my.gguf      # a file of your own
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.common import run_metadata, write_result

DTYPES = ("gguf", "float32")

# Run in the child: load, then report seconds, peak memory and the cache's size.
CHILD = """
import json, os, sys, time
from nasd_core.config import ModelConfig
from nasd_core.loader import load_model
model_name, dtype, cache_dir = sys.argv[1:4]
started = time.perf_counter()
load_model(None if model_name == "embedded" else model_name, ModelConfig(dtype=dtype, cache_dir=cache_dir))
seconds = time.perf_counter() - started
status = dict(line.split(":", 1) for line in open("/proc/self/status"))
cache_bytes = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(cache_dir) for f in fs)
print(json.dumps({"seconds": round(seconds, 2), "peak_rss_mb": int(status["VmHWM"].split()[0]) // 1024,
                  "cache_mb": round(cache_bytes / 2**20, 1)}))
"""


def load_once(model: str, dtype: str, cache_dir: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", CHILD, model, dtype, cache_dir], capture_output=True, text=True, check=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def markdown_table(payload: dict) -> str:
    lines = [
        "| dtype | first load s | first peak RSS MB | cache MB | later load s | later peak RSS MB |",
        "|---|---|---|---|---|---|",
    ]
    for dtype, row in payload["loads"].items():
        first, later = row["first"], row["later"]
        lines.append(
            f"| {dtype} | {first['seconds']} | {first['peak_rss_mb']} | {first['cache_mb']} "
            f"| {later['seconds']} | {later['peak_rss_mb']} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="embedded", help="a *.gguf path (default: the embedded model)")
    args = parser.parse_args()
    loads = {}
    for dtype in DTYPES:
        with tempfile.TemporaryDirectory(prefix="nasd-first-load-") as cache_dir:
            loads[dtype] = {"first": load_once(args.model, dtype, cache_dir)}
            loads[dtype]["later"] = load_once(args.model, dtype, cache_dir)
    payload = {
        "benchmark": "first_load",
        "meta": run_metadata(None, "gguf", "benchmarks.first_load"),
        "model": args.model if args.model == "embedded" else Path(args.model).name,
        "loads": loads,
    }
    path = write_result(
        "first_load" if args.model == "embedded" else f"first_load_{Path(args.model).stem}", payload
    )
    print(markdown_table(payload))
    print(f"\nresults: {path}")


if __name__ == "__main__":
    main()
