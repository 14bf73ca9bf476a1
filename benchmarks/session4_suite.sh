#!/usr/bin/env bash
# Session 4's last benchmark call (2 GPUs, repository root, .whl/ and .peers/ carried), every
# fast-path switch named, so it means the same under later defaults. BENCHMARKS.md, session 4.
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl >/dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
LLAMA="--llama 1 --kv-heads 8 --ffn 8192 --heads 32 --layers 16 --vocab 128256"
FUSED="train.compile=false train.grad_accum_fusion=true"
q() { timeout 100 python3 benchmarks/quick_train.py "$@" 2>&1 | grep -E "RESULT|Error" | tail -2; }
peer() { timeout 100 "$@" 2>&1 | grep -E "^RESULT|Error" | tail -2; }
NPROC=1 q gpt-1.3b $FUSED
peer python3 .peers/torch_gpt_bench.py --mbs 2 --gbs 16
NPROC=2 q gpt-1.3b parallel.zero=1 $FUSED
NPROC=2 q gpt-1.3b parallel.pp=2 parallel.schedule=zb-h1 $FUSED
NPROC=1 q llama-1b $FUSED
peer python3 .peers/torch_gpt_bench.py --mbs 2 --gbs 16 $LLAMA
NPROC=1 q llama-1b train.compile=true train.grad_accum_fusion=false
NPROC=2 q gpt-1.3b parallel.tp=2 parallel.sequence_parallel=true train.compile=true train.grad_accum_fusion=false
PYTHONPATH=/tmp/site:$PYTHONPATH peer torchrun --nproc-per-node 2 .peers/mcore_gpt_bench.py --tp 2
