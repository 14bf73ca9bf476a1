#!/usr/bin/env bash
# Session 4, call 2 (2 GPUs): one GPU with compiled layers vs gradient-accumulation fusion in eager
# layers, and pp=2 under each schedule (BENCHMARKS.md, session 4). Every switch named.
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
q() { timeout 110 python3 benchmarks/quick_train.py gpt-1.3b "$@" 2>&1 | grep -E "RESULT|Error" | tail -2; }
OFF="train.grad_accum_fusion=false"
NPROC=1 q train.compile=true $OFF
NPROC=1 q train.compile=false train.grad_accum_fusion=true
export NPROC=2
q parallel.pp=2 parallel.schedule=zb-h1 train.compile=false $OFF
q parallel.pp=2 parallel.schedule=1f1b train.compile=true $OFF
q parallel.pp=2 parallel.vpp=2 parallel.schedule=interleaved train.compile=true $OFF
q parallel.pp=2 parallel.vpp=2 parallel.schedule=interleaved train.compile=false $OFF
