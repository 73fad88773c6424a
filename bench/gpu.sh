#!/usr/bin/env bash
# The GPU measurements of issue 36, prepared to run in at most 8 minutes on a lent GPU (an H200: Python 3.12,
# its own torch, no network).
#
# Parts, each under a timeout of its own (and all together under GPU_BUDGET_S, 470 s by default), so one
# slow part cannot eat the others' time; each writes its log under $OUT:
#   1. install   the abi3 wheel from dist/ and the carried wheels of .gpu-wheels/ into /tmp/site
#                (the server's and the tests' dependencies the machine's image lacks: fastapi, uvicorn,
#                pydantic-settings, opentelemetry-api, httptools, blake3, zstandard, …), --no-deps, no index;
#   2. tests     the CUDA tests: pytest -k cuda over tests/ (files whose imports fail, e.g. schemathesis,
#                are reported and skipped);
#   3. optimizer_step_10M / _100M   bench/optimizer_step.py --device cuda at 10 M and 100 M parameters:
#                torch AdamW foreach and fused, DeMo's reference, gradwire DeMo and SparseLoCo;
#   4. dct_codec bench/dct_codec.py --devices cuda at k = 1 … 512 of 4096, and the decode's routes;
#      int_decode bench/int_decode.py: the float64 routes against the integer one, and what `auto` keeps;
#   5. train_step  bench/train_step.py: a GPT-2-shaped 124 M-parameter model, bf16 autocast, batch
#                8 × 1024 tokens, AdamW (fused) vs DeMo vs SparseLoCo;
#   then summary.md: every part's exit status and time, every table and every "target …: met / missed" line.
#
# How to run it with the device tool (from the checkout the session was started in):
#   here:   make wheel gpu-wheels     # dist/*.whl built from this checkout, .gpu-wheels/ (~10 MiB); both ignored
#   there:  run(command="bash bench/gpu.sh", carry=["dist", ".gpu-wheels"], timeout_s=540)
# The files come back from $OUT (at most 8: this script writes 8). Without $OUT (a GPU machine of your own),
# the logs go to bench/out/gpu/. The wheel must be built from the commit being measured: the script uses the
# installed wheel's gradwire and says so if its Python sources differ from the tree's.
#
# On a machine without CUDA every part still runs (the CUDA tests skip, the benches run on the CPU), which
# is how it was tried without a GPU: GPU_SMALL=1 makes every part tiny, GPU_SKIP_INSTALL=1 uses the
# environment as it is (the carried wheels are for Python 3.12):
#   source env.sh && GPU_SMALL=1 GPU_SKIP_INSTALL=1 PYTHON=python OUT=/tmp/gpu_try bash bench/gpu.sh

set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-bench/out/gpu}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
BUDGET="${GPU_BUDGET_S:-470}"
START=$(date +%s)
SUMMARY="$OUT/summary.md"
: >"$SUMMARY"

# part NAME LIMIT_S COMMAND...: run COMMAND under min(LIMIT_S, what is left of the budget), log to $OUT/NAME.log.
part() {
    local name=$1 limit=$2
    shift 2
    local left=$((BUDGET - ($(date +%s) - START)))
    if ((left < 10)); then
        echo "## $name: not run (the budget of ${BUDGET}s is spent)" | tee -a "$SUMMARY"
        return
    fi
    ((limit > left)) && limit=$left
    echo "== $name (at most ${limit}s): $*"
    local t0=$(date +%s)
    timeout -k 5 "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    local took=$(($(date +%s) - t0))
    local what="rc $rc"
    ((rc == 124 || rc == 137)) && what="timed out after ${limit}s"
    echo "## $name: $what, ${took}s" | tee -a "$SUMMARY"
    tail -n 25 "$OUT/$name.log"
}

SMALL="${GPU_SMALL:-0}"
if [[ "$SMALL" == 1 ]]; then
    OS_10=(--params 1M --repeat 1) OS_100=(--params 2M --repeat 1)
    DCT=(--side 512 --topk 1 32 --repeat 1)
    TRAIN=(--batch 2 --seq 32 --layers 2 --width 64 --heads 2 --vocab 256 --repeat 1)
else
    OS_10=(--params 10M --repeat 5) OS_100=(--params 100M --repeat 5)
    DCT=(--topk 1 8 32 128 512 --repeat 5 --routes)
    TRAIN=(--batch 8 --seq 1024 --repeat 3)
fi

install() {
    set -e
    "$PY" --version
    "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || true
    ls dist/*.whl .gpu-wheels/*.whl
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        dist/*.whl .gpu-wheels/*.whl
    # The wheel is what runs: say whether it was built from this tree's Python sources.
    local differ
    differ=$(cd python && find gradwire -name '*.py' | while read -r f; do cmp -s "$f" "/tmp/site/$f" || echo "$f"; done)
    if [[ -n "$differ" ]]; then
        echo "WARNING: the wheel's Python differs from the tree's (run make wheel): $differ"
    else
        echo "the wheel's Python sources are the tree's"
    fi
    PYTHONPATH=/tmp/site "$PY" -c "import gradwire, fastapi, uvicorn, pydantic_settings, blake3; print('gradwire', gradwire.__file__)"
}

export PY
export -f install  # timeout runs commands, not functions: it runs `bash -c install`
if [[ "${GPU_SKIP_INSTALL:-0}" == 1 ]]; then
    # A try-out on a machine that already has gradwire and the dependencies (the CPU machine's venv).
    echo "## install: skipped (GPU_SKIP_INSTALL=1)" | tee -a "$SUMMARY"
    export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD/server:$PWD/tests"
else
    part install 60 bash -c install
    export PYTHONPATH="/tmp/site:$PWD/server:$PWD/tests"
fi
if [[ "$SMALL" == 1 ]]; then
    part tests 120 "$PY" -m pytest -q -p no:cacheprovider -k cuda --continue-on-collection-errors tests/test_step_ops_bench.py tests/test_dct_codec.py
else
    part tests 120 "$PY" -m pytest -q -p no:cacheprovider -rs -k cuda --continue-on-collection-errors tests
fi
DEV=cuda
"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null || DEV=cpu
part optimizer_step_10M 50 "$PY" bench/optimizer_step.py --device "$DEV" --models linear "${OS_10[@]}" --out "$OUT/optimizer_step_10M.md"
part optimizer_step_100M 100 "$PY" bench/optimizer_step.py --device "$DEV" --models linear "${OS_100[@]}" --out "$OUT/optimizer_step_100M.md"
part dct_codec 60 "$PY" bench/dct_codec.py --devices "$DEV" "${DCT[@]}"
part int_decode 25 "$PY" bench/int_decode.py --device "$DEV" --reps 3
part train_step 100 "$PY" bench/train_step.py --device "$DEV" "${TRAIN[@]}"

{
    echo
    echo "# bench/gpu.sh, $(date -u +%Y-%m-%dT%H:%MZ), $(($(date +%s) - START))s"
    for f in optimizer_step_10M optimizer_step_100M; do
        [[ -f "$OUT/$f.md" ]] && { echo; cat "$OUT/$f.md"; }
    done
    echo
    grep -h -E "^(│|┃|┏|┡|└)|DCT codec vs|Exact decode by route" "$OUT/dct_codec.log" 2>/dev/null
    echo
    sed -n '/^Exact decode routes/,$p' "$OUT/int_decode.log" 2>/dev/null
    echo
    sed -n '/^A training step/,$p' "$OUT/train_step.log" 2>/dev/null
    echo
    grep -h -E "passed|failed|error" "$OUT/tests.log" 2>/dev/null | tail -n 3
} >>"$SUMMARY"
rm -f "$OUT"/optimizer_step_10M.md "$OUT"/optimizer_step_100M.md  # in the summary: 8 files come back
cat "$SUMMARY"
