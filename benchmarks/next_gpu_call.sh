#!/usr/bin/env bash
# Session 4, GPU call 3 (2 GPUs, repository root, .whl/ and .peers/ carried): gradient-accumulation
# fusion together with compiled layers (the fused linear layers run eagerly between compiled
# pieces), at every layout, against compiled layers alone; the 200-step fast-path curve test.
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
q() { timeout 110 python3 benchmarks/quick_train.py gpt-1.3b "$@" 2>&1 | grep -E "RESULT|Error" | tail -2; }
NPROC=1 q train.compile=true train.grad_accum_fusion=false
NPROC=1 q train.compile=true train.grad_accum_fusion=true
export NPROC=2
q parallel.zero=1 train.grad_accum_fusion=true
q parallel.pp=2 parallel.schedule=zb-h1 train.compile=true train.grad_accum_fusion=false
q parallel.pp=2 parallel.schedule=zb-h1 train.compile=true train.grad_accum_fusion=true
q parallel.tp=2 parallel.sequence_parallel=true train.compile=true train.grad_accum_fusion=true
timeout 100 python3 -m pytest -q -rs tests/test_gpu.py -k "fast_paths" 2>&1 | tail -2
