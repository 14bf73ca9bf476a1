#!/usr/bin/env bash
# What the next GPU call runs first (2 GPUs, repository root, .whl/ and .peers/ carried): the
# whole GPU test file under the current defaults, its log kept under $OUT (the last call's tp=2
# failure was cut off with its output). Every tp=2 variant of the NCCL test runs and is named.
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
timeout 560 python3 -m pytest -q -rs -x tests/test_gpu.py 2>&1 | tee ${OUT:-/tmp}/gpu_tests.log | tail -40
