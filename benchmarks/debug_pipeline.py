"""Run a few pipeline steps of a small model under torchrun with a watchdog that dumps every
thread's stack if a step hangs (for debugging p2p on a new backend).

Usage: torchrun --nproc-per-node 2 benchmarks/debug_pipeline.py SCHEDULE VPP
"""

import faulthandler
import sys

from tessera.config import load_config
from tessera.training.trainer import train

kind, vpp = sys.argv[1], sys.argv[2]
faulthandler.dump_traceback_later(60, exit=True)
cfg = load_config(None, ["model.layers=4", "parallel.pp=2", f"parallel.vpp={vpp}", f"parallel.schedule={kind}",
                         "train.steps=3", "train.log_every=1", "data.source=synthetic", "train.out_dir=/tmp/dbg"])
train(cfg)
print("OK", kind, vpp, flush=True)
