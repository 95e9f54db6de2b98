#!/bin/bash
# One device call: install the engine, run the GPU tests, run the kernel benchmarks; results in $OUT.
#   bash benchmarks/device_run.sh [tests|attention|gemm|moe|e2e ...]   (default: all of them)
# Python packages the machine lacks travel as wheels in .whl/ (carried with the call): msgspec, the
# engine's wire format, is one (pip download msgspec --only-binary :all: --python-version 3.12
# --platform manylinux_2_17_x86_64 --no-deps -d .whl), transformers for dsv4_decode another, and
# xgrammar with apache-tvm-ffi for structured outputs (core/structured/, tests that constrain output).
set -o pipefail
export PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/engine-out}
mkdir -p "$OUT"
if [ ! -f /tmp/engine-installed ]; then  # once a machine: calls running side by side share it
  if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      || exit 1
  fi
  python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
  touch /tmp/engine-installed
fi
[ ! -d /tmp/site ] || export PYTHONPATH=/tmp/site
{ nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv; git rev-parse --short HEAD;
  git status --short; python3 -c 'import torch, triton; print(torch.__version__, triton.__version__)'; } >"$OUT/env.txt" 2>&1
steps=${*:-tests attention gemm moe}
for step in $steps; do
  echo "== $step"
  case $step in
    tests) timeout ${TESTS_TIMEOUT:-420} python3 -m pytest -q -m gpu ${TESTS:-tests/backends tests/core/native} 2>&1 \
             | tee "$OUT/gpu-tests.log" | tail -25 ;;
    attention) timeout 300 python3 benchmarks/attention_bench.py --json "$OUT/attention-h200.json" 2>&1 | tail -40 ;;
    gemm) timeout 300 python3 benchmarks/gemm_bench.py --json "$OUT/gemm-h200.json" 2>&1 | tail -40 ;;
    moe) timeout 300 python3 benchmarks/moe_bench.py --json "$OUT/moe-h200.json" 2>&1 | tail -30 ;;
    fp8_quant_diag) timeout 60 python3 benchmarks/fp8_quant_diag.py ;;
    dsv4_decode) timeout 570 python3 benchmarks/dsv4_decode.py --json "$OUT/dsv4_decode-h200.json" 2>&1 | tee "$OUT/dsv4_decode.log" | tail -40 ;;
    models) mkdir -p ../shared/models ../shared/data && cp -r .models/* ../shared/models/ \
              && { [ ! -d .data ] || cp -r .data/* ../shared/data/; } ;;  # .data: python-eval.txt for the drafter tests
    train_tiny_v41) timeout 600 python3 -m engine.checkpoints.train_tiny_v41 --tokenizer ../shared/models/tiny-dsv4-py \
                      --data "$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')" \
                      --eval ../shared/data/python-eval.txt --out "$OUT/tiny-dsv41-py" --minutes ${TRAIN_MINUTES:-6} \
                      2>&1 | tee "$OUT/train_tiny_v41.log" | tail -15 ;;
    train_dspark) timeout 570 python3 -m engine.server.cli train-drafter --model ../shared/models/tiny-dsv4-py \
                    --method dspark --data "$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')" \
                    --eval ../shared/data/python-eval.txt --out "$OUT/tiny-dsv4-py-dspark" --steps ${DSPARK_STEPS:-40000} \
                    --batch-size 16 --seq-len 256 --max-tokens 20000000 --max-minutes ${TRAIN_MINUTES:-6} \
                    2>&1 | tee "$OUT/train_dspark.log" | tail -15 ;;
    pack) cd "$OUT" && tar cf /tmp/trained.tar tiny-* train_*.log && rm -rf tiny-* train_*.log \
            && split -b 15M /tmp/trained.tar trained.tar.part- && cd - >/dev/null ;;  # checkpoints and their logs
            # come back as 15 MiB parts: a call returns at most 8 files of 16 MiB each
    serve) timeout 300 bash benchmarks/serve_on_device.sh 2>&1 | tail -45 ;;
    *) timeout 280 python3 "benchmarks/$step.py" --json "$OUT/$step-h200.json" 2>&1 | tee "$OUT/$step.log" | tail -30 ;;
  esac
done
