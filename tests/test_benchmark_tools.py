"""The benchmark runner's plumbing (the GPU runs themselves happen on the GPU machine)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import compare  # noqa: E402


def test_reads_both_result_formats():
    assert compare.tokens_per_gpu("x\nRESULT gpt-1.3b nproc=2 parallel.zero=1: 52,041 tokens/s per GPU, 1 TFLOP/s") == 52041
    assert compare.tokens_per_gpu('RESULT {"system": "m", "tokens_per_s_per_gpu": 24651, "x": 1}') == 24651
    assert compare.tokens_per_gpu("no result here") is None


def test_dry_run_lists_tessera_and_both_peers():
    out = subprocess.run([sys.executable, "benchmarks/compare.py", "llama-1b", "1gpu", "tp2", "--dry-run"],
                         cwd=ROOT, capture_output=True, text=True, check=True).stdout.splitlines()
    assert len(out) == 5  # 1gpu: tessera, megatron-core, PyTorch; tp2: tessera, megatron-core
    assert "quick_train.py llama-1b" in out[0] and "mcore_gpt_bench.py" in out[1] and "--llama 1" in out[1]
    assert "parallel.tp=2" in out[3] and "--tp 2" in out[4]
