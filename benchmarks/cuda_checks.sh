#!/usr/bin/env bash
# The CUDA checks and figures, in one run: every CUDA test of the suite, then the benchmark
# cases' CUDA figures (recorded in docs/benchmarks.md with the card and date they came from).
#
#   bash benchmarks/cuda_checks.sh OUT_DIR [STEP ...]    # from the repository root, on a CUDA machine
#
# Needs torch with CUDA and the project's dependencies importable (PYTHONPATH=src is set here;
# nothing is installed). Each step's log goes to OUT_DIR/<step>.log and its results under
# OUT_DIR/<step>/; the last lines of each log are printed. STEPs: tests peers capture decode
# (the default: at most 9 minutes with every step at its limit, about 6 on an H100, within one
# 10-minute device call) and syncs flex moh views.
# The tests step runs WORKERS processes (default 8) where pytest-xdist is installed.
set -u
out=${1:?usage: bash benchmarks/cuda_checks.sh OUT_DIR [STEP ...]}
shift
steps=${*:-tests peers capture decode}
mkdir -p "$out"
export PYTHONPATH=src PYTHONUNBUFFERED=1 MULTIHEAD_CACHE="$out/cache"
py=${PYTHON:-python3}
workers=$($py -c "import xdist" 2>/dev/null && echo "-n ${WORKERS:-8}")  # parallel tests where pytest-xdist is there

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
$py -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"

run() {  # run NAME SECONDS COMMAND...: time-limited, logged, its tail printed
    local name=$1 limit=$2
    shift 2
    echo "== $name"
    timeout "$limit" "$@" >"$out/$name.log" 2>&1
    echo "rc=$?"
    tail -n "${TAIL:-6}" "$out/$name.log"
}

bench() {  # bench NAME SECONDS CASE ARGS...: one benchmark case on CUDA
    local name=$1 limit=$2 case=$3
    shift 3
    run "$name" "$limit" $py -m benchmarks.run "$case" --out "$out/$name" "$@"
}

for step in $steps; do
    case $step in
    tests) # one line per test as it ends (-v), so a run cut by its limit still names what failed
        TAIL=5 run tests 240 $py -m pytest tests -v --tb=line -rfEs -p no:cacheprovider -p no:benchmark \
            -o addopts=--import-mode=importlib $workers --continue-on-collection-errors -k "cuda or gpu"
        grep -E " (FAILED|ERROR) |^(FAILED|ERROR) |^E " "$out/tests.log" | head -60 ;;
    peers) bench peers 90 attention_peers --device cuda --set dtype=bfloat16 --number 10 \
        --set "cuda_peers=['sdpa_flash','sdpa_cudnn','sdpa_efficient']" \
        --scenario "forward, causal" --scenario "fwd+bwd, causal" ;;
    capture) bench capture 60 capture_overhead --set device=cuda --set dtype=bfloat16 ;;
    flex) bench flex 90 flex_backend --set device=cuda --set dtype=bfloat16 --rounds 10 \
        --scenario causal --scenario "causal + alibi" --scenario "causal + softcap" ;;
    moh) bench moh 60 moh_active_heads --set device=cuda --rounds 20 --scenario "core forward, 50% active" \
        --scenario "core forward causal, 50% active, B=1 T=2048" --scenario "forward causal, 50% active, B=1 T=2048" ;;
    syncs) TAIL=20 run syncs 60 $py -m benchmarks.cuda_syncs --rounds 9 ;;
    views) TAIL=16 run views 80 $py -m benchmarks.cuda_views ;;
    decode) TAIL=24 run decode 150 $py -m benchmarks.decode_vs_hf --device cuda --modes eager compiled \
        --formats fp32 bf16 --batches 1,8 --rounds 3 ;;
    *) echo "unknown step $step" ;;
    esac
done
