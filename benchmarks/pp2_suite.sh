#!/usr/bin/env bash
# The pipeline figures of BENCHMARKS.md, in one call on a 2-GPU machine (repository root).
# Needs .whl/ (megatron-core wheel) and .peers/ (../shared/peers scripts) carried along.
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 300 python3 -m pytest -q -x tests/test_gpu.py 2>&1 | tail -5
timeout 100 torchrun --nproc-per-node 2 benchmarks/debug_pipeline.py interleaved 2 2>&1 | tail -3
timeout 150 python3 benchmarks/quick_train.py gpt-1.3b 2>&1 | grep RESULT
for kv in "1f1b 1" "interleaved 2" "zb-h1 1"; do set -- $kv
  NPROC=2 timeout 150 python3 benchmarks/quick_train.py gpt-1.3b parallel.pp=2 parallel.vpp=$2 parallel.schedule=$1 2>&1 | grep -E "RESULT|Error|error" | tail -3
done
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1 | tail -1
PYTHONPATH=/tmp/site:$PYTHONPATH timeout 150 torchrun --nproc-per-node 2 .peers/mcore_gpt_bench.py --pp 2 2>&1 | grep RESULT
