#!/usr/bin/env bash
# One command for everything a GPU run measures (docs/gpu.md), run from the repository root:
#
#   OUT=/some/dir bash bench/gpu_check.sh                      # on the device: DEVICE=cuda, SIZE=full
#   DEVICE=cpu SIZE=tiny PYTHON=.venv/bin/python bash bench/gpu_check.sh   # the CPU check the suite runs
#
# Steps, each under its own time limit; one that fails is recorded and the rest still run (a device's
# minutes are few): install the carried wheels (.gpu/wheels, `make gpu-wheels`) that this Python
# lacks; the engine's equivalence tests and the differential fuzz on DEVICE in float32 and bfloat16;
# a random model of SmolLM2's shape; batchgen, batched `generate` and `generate_batch` in one process
# (bench/gpu_check.py: tokens/s, wall, kernels and syncs per decode step, peak memory); bench_decode;
# bench_engine where pyarrow is there (its batchgen runs are `batchgen process`, which writes Parquet).
# Everything lands under OUT: a log per step, steps.tsv, JSON, and summary.md. Exit 1 if a step failed.
set -uo pipefail
cd "$(dirname "$0")/.."
DEVICE=${DEVICE:-cuda}
SIZE=${SIZE:-full}
PYTHON=${PYTHON:-$(command -v python3 || command -v python)}
OUT=${OUT:-out/gpu_check}
CARRY=${CARRY:-.gpu}
# the whole script's seconds: steps get what is left, and the summary is always written (the CPU check's
# tiny sizes on a shared 2-core machine take longer than the device's full ones)
if [ "$SIZE" = tiny ]; then BUDGET_S=${BUDGET_S:-1200}; else BUDGET_S=${BUDGET_S:-330}; fi
DEADLINE=$(($(date +%s) + BUDGET_S - 15))
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")
# batchgen as installed, without a build step: `batchgen.jobs` and `batchgen.pipeline` are the repository's
# jobs/ and pipeline/ (pyproject's package-dir). Links inside batchgen/ (gitignored), since Python puts
# the working directory, where batchgen/ is, before PYTHONPATH; removed at exit where made here
LINKS=()
for d in jobs pipeline; do
    if [ ! -e "batchgen/$d" ]; then ln -s "../$d" "batchgen/$d" && LINKS+=("batchgen/$d"); fi
done
trap 'rm -rf "$WORK"; for l in ${LINKS[@]+"${LINKS[@]}"}; do rm -f "$l"; done' EXIT
: > "$OUT/steps.tsv"
# no network there: never let transformers or the Hub try
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 TOKENIZERS_PARALLELISM=false
export PYTHONPATH="$WORK/site:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONDONTWRITEBYTECODE=1
if [ "$SIZE" = tiny ]; then
    SEEDS=0:1 FUZZ_S=60 LAYERS=2 ONLY=" and llama" DECODE_ARGS="--rows 2 --prefix 32 --repeat 1 --systems cascade,generate"
    ENGINE_ARGS="--workloads system_prompt --limit 4 --max-new-tokens 4 --turns 1"
else
    SEEDS=0:60 FUZZ_S=40 LAYERS=0 ONLY=""
    DECODE_ARGS="--rows 64 --prefix 2048 --repeat 2 --systems cascade,generate --max-generate-tokens 1000000"
    ENGINE_ARGS="--workloads system_prompt --turns 1"
fi
FAILED=0

# step NAME SECONDS NOTE COMMAND...: run it with its output in OUT/NAME.log, and record its exit status
step() {
    local name=$1 limit=$2 note=$3 start rc ms left
    shift 3
    left=$((DEADLINE - $(date +%s)))
    if [ $left -lt 20 ]; then
        skip "$name" "no time left of BUDGET_S=$BUDGET_S" 124
        FAILED=1
        return 1
    fi
    [ $limit -gt $left ] && limit=$left
    start=$(date +%s%N)
    echo "== $name (limit ${limit}s): $*"
    timeout -k 10 "$limit" "$@" > "$OUT/$name.log" 2>&1
    rc=$?
    [ $rc -eq 124 ] && note="timed out after ${limit}s; $note"
    [ $rc -ne 0 ] && FAILED=1
    ms=$((($(date +%s%N) - start) / 1000000))
    printf '%s\t%s\t%d.%03d\t%s\n' "$name" "$rc" $((ms / 1000)) $((ms % 1000)) "$note" >> "$OUT/steps.tsv"
    tail -n 4 "$OUT/$name.log"
    return $rc
}
skip() {
    printf '%s\t%s\t0\tskipped: %s\n' "$1" "${3:-0}" "$2" >> "$OUT/steps.tsv"
    echo "== $1 skipped: $2"
}

ROOTS=()
for r in ${EXTRA_ROOTS:-}; do ROOTS+=(--root "$r"); done  # more requirements to meet from the carried wheels
step install 120 "carried wheels from $CARRY/wheels" "$PYTHON" -m bench.gpu_install --wheels "$CARRY/wheels" \
    --site "$WORK/site" --report "$OUT/env.json" ${ROOTS[@]+"${ROOTS[@]}"}
"$PYTHON" -c 'import batchgen, torch, transformers; print("batchgen from", batchgen.__file__, "torch", torch.__version__,
"transformers", transformers.__version__, "cuda", torch.cuda.is_available() and torch.cuda.get_device_name())' \
    2>&1 | tee "$OUT/versions.txt"

# one pytest process for both dtypes (its start-up is not free); the summary splits the results by test name

TESTS="(greedy_equals_uncached_generate or static_decode_steps or bfloat16_greedy)$ONLY"
BATCHGEN_TEST_DEVICE=$DEVICE step equivalence 180 "tests/engine/test_engine.py -k '$TESTS'" \
    "$PYTHON" -m pytest -q -p no:cacheprovider tests/engine/test_engine.py -k "$TESTS" --junitxml "$OUT/equivalence.xml"
MODEL="$WORK/smollm2-random"
SHAPE=()
[ -f "$CARRY/smollm2/config.json" ] && SHAPE=(--shape "$CARRY/smollm2")
MODEL_OK=0
step model 120 "random weights, SmolLM2-135M's shape" \
    "$PYTHON" -m bench.gpu_check model ${SHAPE[@]+"${SHAPE[@]}"} --dest "$MODEL" --layers "$LAYERS" && MODEL_OK=1
[ $MODEL_OK = 1 ] && step bench 240 "batchgen, generate, generate_batch; bfloat16" \
    "$PYTHON" -m bench.gpu_check bench --model "$MODEL" --device "$DEVICE" --dtype bfloat16 --size "$SIZE" --out "$OUT"
step fuzz $((FUZZ_S + 60)) "seeds $SEEDS in float32 and bfloat16, new seeds started for ${FUZZ_S}s" bash -c \
    "'$PYTHON' -m tests.engine.fuzz_engine --seeds $SEEDS --dtype both --device $DEVICE --max-seconds $FUZZ_S \
    > '$OUT/fuzz.jsonl'"
if [ $MODEL_OK = 1 ]; then
    step bench_decode 150 "one group of B rows over a P-token prefix; bfloat16" bash -c \
        "'$PYTHON' -m bench.bench_decode --device $DEVICE --dtype bfloat16 --model '$MODEL' $DECODE_ARGS \
        --json '$OUT/bench_decode.json' > '$OUT/bench_decode.md'"
    if "$PYTHON" -c 'import pyarrow, click' 2>/dev/null; then
        step bench_engine 180 "whole processes; bfloat16" bash -c \
            "'$PYTHON' -m bench.bench_engine --systems batchgen-bf16,hf-batched-bf16 --device $DEVICE --model '$MODEL' \
            $ENGINE_ARGS --json '$OUT/bench_engine.json' > '$OUT/bench_engine.md'"
    else
        skip bench_engine "no pyarrow on this Python (a wheel does not fit the carry limit)"
    fi
fi

"$PYTHON" -m bench.gpu_check summary --out "$OUT" > /dev/null || FAILED=1
cat "$OUT/summary.md"
exit $FAILED
