#!/usr/bin/env bash
# What the next GPU call runs first (2 GPUs, repository root, .whl/ and .peers/ carried): the
# first A/B of the FLOPs-balanced pipeline split (short), then the whole GPU test file under the
# current defaults with its log kept under $OUT (the last call's tp=2 failure was cut off with its
# output); every tp=2 variant of the NCCL test runs and is named. Under 600 s in all.
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
for layout in "" balanced; do
  NPROC=2 timeout 90 python3 benchmarks/quick_train.py gpt-1.3b parallel.pp=2 parallel.schedule=zb-h1 \
    "parallel.pp_layout=$layout" 2>&1 | grep -E "RESULT|Error" | tail -2
done
timeout 390 python3 -m pytest -q -rs tests/test_gpu.py 2>&1 | tee ${OUT:-/tmp}/gpu_tests.log | tail -40
