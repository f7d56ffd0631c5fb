#!/usr/bin/env bash
# The prepared GPU check: one command on a machine with one CUDA GPU (the device tool's H200), writing what it
# measured under $OUT (the JSON rows, the log, the regenerated BENCHMARKS.md).
#
#   bash benchmarks/gpu_check.sh bench_gpu      # issue 29 (and Sol-RL's candidate stage): at most 8 minutes on one H200
#   bash benchmarks/gpu_check.sh bench_quant    # issue 30: bench_quant.py --gpu, FP8 backends x formats, 2B forward
#
# That machine has torch, transformers, peft and accelerate but not diffusers: carry its wheel. Here, once:
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_17_x86_64 -d .whl diffusers==0.42.1
# then run this script there, one benchmark per command, with `.whl` carried and a time limit of LIMIT plus a little
# for the wheel's install and nvidia-smi (e.g. 570 s: one command may take 600 s, the session 15 minutes).
# Each benchmark runs under `timeout $LIMIT`; bench_gpu.py gets the same limit (--time-limit), prints its stage
# budgets' sum against it before it starts, and starts no stage past it (tests/test_benchmarks.py checks they agree).
# Copy $OUT/BENCHMARKS.md over the checkout's only after reading the rows.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_check_out}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD
fi
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TQDM_DISABLE=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
LIMIT=540
status=0
for bench in "${@:-bench_gpu}"; do
    extra=()
    [ "$bench" = bench_quant ] && extra=(--gpu)
    [ "$bench" = bench_gpu ] && extra=(--time-limit "$LIMIT")
    timeout "$LIMIT" python3 "benchmarks/$bench.py" "${extra[@]}" --json "$OUT/$bench.json" 2>&1 | tee "$OUT/$bench.log" || status=1
done
cp BENCHMARKS.md "$OUT/BENCHMARKS.md"
exit $status
