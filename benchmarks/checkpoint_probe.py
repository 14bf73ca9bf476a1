"""Where the first step after a checkpoint save loses its time (session 26: GPT-1.3B on one H200,
the step after a 26 s save took 53 s, and 19.6 s after a 9 s background-save copy; the next steps
ran at full speed). Runs the trainer in this process with host timings around each step's launch,
its GPU work (a synchronize), the save and the Python garbage collector.

Usage: python benchmarks/checkpoint_probe.py [gpt-1.3b|llama-1b] [extra --set overrides...]
"""

import gc
import shutil
import sys
import tempfile
import time

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from quick_train import MODELS  # noqa: E402

from tessera.checkpoint import checkpointer as ck  # noqa: E402
from tessera.config import load_config  # noqa: E402
from tessera.training import trainer  # noqa: E402

name = sys.argv[1] if len(sys.argv) > 1 else "gpt-1.3b"
root = tempfile.mkdtemp()
cfg = load_config(None, MODELS[name] + ["train.micro_batch=2", "train.global_batch=16", "train.dtype=bf16",
                                        "data.source=synthetic", "train.steps=7", "train.log_every=1",
                                        "optim.decay_steps=9", f"train.out_dir={root}/out",
                                        f"checkpoint.dir={root}/ck", "checkpoint.save_every=3", *sys.argv[2:]])
t0 = time.perf_counter()


def stamp(what):
    print(f"PROBE {time.perf_counter() - t0:8.2f} s  {what}", flush=True)


real_step, real_save = trainer.train_step, ck.Checkpointer.save


def timed_step(*args, **kwargs):
    began = time.perf_counter()
    result = real_step(*args, **kwargs)
    launched = time.perf_counter()
    torch.cuda.synchronize()
    stamp(f"step launched in {launched - began:.2f} s, GPU done {time.perf_counter() - launched:.2f} s later")
    return result


def timed_save(self, *args, **kwargs):
    began = time.perf_counter()
    out = real_save(self, *args, **kwargs)
    stamp(f"save returned after {time.perf_counter() - began:.2f} s")
    return out


gc.callbacks.append(lambda phase, info: stamp(f"gc {phase} gen {info['generation']}") if info["generation"] == 2 else None)
trainer.train_step, ck.Checkpointer.save = timed_step, timed_save
trainer.train(cfg)
shutil.rmtree(root, ignore_errors=True)
