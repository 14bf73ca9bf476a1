#!/usr/bin/env bash
# What the next GPU calls run first (2 GPUs, repository root, .whl/ and .peers/ carried), each
# well under the 600 s per command:
#   bash benchmarks/next_gpu_call.sh tests  -- the whole GPU test file under the current defaults,
#       its log kept under $OUT (the last call's tp=2 failure was cut off with its output); every
#       tp=2 variant of the NCCL test runs and is named
#   bash benchmarks/next_gpu_call.sh ab     -- first A/Bs: the FLOPs-balanced pipeline split
#       against the even one (pp=2), and the ring (p2p) async TP against plain SP (tp=2)
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
q() { NPROC=2 timeout 100 python3 benchmarks/quick_train.py gpt-1.3b "$@" 2>&1 | grep -E "RESULT|Error" | tail -2; }
case "${1:-tests}" in
  tests) timeout 560 python3 -m pytest -q -rs tests/test_gpu.py 2>&1 | tee "${OUT:-/tmp}/gpu_tests.log" | tail -40 ;;
  ab)
    for layout in "" balanced; do q parallel.pp=2 parallel.schedule=zb-h1 "parallel.pp_layout=$layout"; done
    for v in false p2p; do q parallel.tp=2 parallel.sequence_parallel=true "parallel.tp_async=$v"; done ;;
  *) echo "usage: $0 tests|ab" >&2; exit 2 ;;
esac
