#!/usr/bin/env bash
# What the next GPU call should run first (2 GPUs, repository root, .whl/ and .peers/ carried):
# the whole GPU test file under the current defaults, then the figures BENCHMARKS.md lacks.
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
timeout 420 python3 -m pytest -q -rs tests/test_gpu.py 2>&1 | tail -6
for v in "train.compile=false" "train.compile=true" "parallel.tp_async=true" "parallel.tp_async=true train.compile=true"; do
  # compiled layers under TP (train.compile=auto leaves them off at tp > 1); async TP (symmetric memory)
  NPROC=2 timeout 120 python3 benchmarks/quick_train.py gpt-1.3b parallel.tp=2 parallel.sequence_parallel=true \
    $v 2>&1 | grep -E "RESULT|Error"
done
timeout 400 python3 benchmarks/compare.py llama-1b tp2 2>&1 | tail -5
