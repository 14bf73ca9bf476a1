#!/usr/bin/env bash
# A/B of the fast paths on the GPT-1.3B benchmark model, one call (repository root, 1-2 GPUs):
# each fast path off and on, on 1 GPU, and dp=2 all off and with the defaults. Every switch is
# named, so the lines mean the same whatever the defaults are. Prints RESULT lines.
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
run() { timeout 240 python3 benchmarks/quick_train.py "$@" 2>&1 | grep -E "RESULT|Error|error" | tail -3; }
OFF="train.grad_accum_fusion=false train.fused_cross_entropy=false train.compile=false"
run gpt-1.3b $OFF
run gpt-1.3b train.grad_accum_fusion=true train.fused_cross_entropy=false train.compile=false  # + grad-accum fusion
run gpt-1.3b train.grad_accum_fusion=false train.fused_cross_entropy=true train.compile=false  # + fused cross entropy
run gpt-1.3b train.grad_accum_fusion=true train.fused_cross_entropy=true train.compile=false   # both
run gpt-1.3b train.grad_accum_fusion=false train.fused_cross_entropy=true train.compile=true   # fused CE + compiled layers
if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
  NPROC=2 run gpt-1.3b parallel.zero=1 $OFF
  NPROC=2 run gpt-1.3b parallel.zero=1
fi
