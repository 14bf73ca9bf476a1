#!/usr/bin/env bash
# The data-parallel figures of BENCHMARKS.md, in one call on a 2-GPU machine (repository root).
# Needs .whl/ (megatron-core wheel) and .peers/ (../shared/peers scripts) carried along.
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 150 python3 benchmarks/quick_train.py gpt-1.3b 2>&1 | grep -E "RESULT|Error"
for z in 0 1; do
  NPROC=2 timeout 150 python3 benchmarks/quick_train.py gpt-1.3b parallel.zero=$z 2>&1 | grep -E "RESULT|Error|model state"
done
for v in parallel.grad_reduce_dtype=bf16 train.grad_dtype=bf16; do  # fp32 sums; bf16 on the wire / in the buffer
  NPROC=2 timeout 150 python3 benchmarks/quick_train.py gpt-1.3b parallel.zero=1 $v 2>&1 | grep -E "RESULT|Error"
done
timeout 200 torchrun --nproc-per-node 2 .peers/torch_gpt_bench.py --mbs 2 --gbs 16 2>&1 | grep -E "RESULT|Error"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1 | tail -1
PYTHONPATH=/tmp/site:$PYTHONPATH timeout 150 torchrun --nproc-per-node 2 .peers/mcore_gpt_bench.py 2>&1 | grep -E "RESULT|Error"
