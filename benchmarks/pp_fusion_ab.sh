#!/usr/bin/env bash
# One call, 2 GPUs: one GPU with compiled layers vs gradient-accumulation fusion, and pp=2 under
# each schedule with what train.compile=auto picks for it (ZB-H1 eager, 1F1B/interleaved compiled).
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
q() { timeout 110 python3 benchmarks/quick_train.py gpt-1.3b "$@" 2>&1 | grep -E "RESULT|Error" | tail -2; }
NPROC=1 q
NPROC=1 q train.compile=false train.grad_accum_fusion=true
export NPROC=2
q parallel.pp=2 parallel.schedule=zb-h1
q parallel.pp=2 parallel.schedule=1f1b
q parallel.pp=2 parallel.vpp=2 parallel.schedule=interleaved
q parallel.pp=2 parallel.vpp=2 parallel.schedule=interleaved train.compile=false
