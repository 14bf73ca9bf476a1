"""``tessera checkpoint inspect PATH``: what a checkpoint holds, without loading it.

PATH is a ``step_N`` folder or a folder of them (each one listed). Prints the step, when and on
which layout it was saved, its size, the model's settings and parameter count, the data position
and the learning-rate schedule's end; ``--tensors`` lists every tensor's whole shape. A damaged
checkpoint (a data file missing or cut short, an unreadable ``tessera.json``) is named as such
(exit status 1).
"""

from __future__ import annotations

import math
import os
import sys


def add_checkpoint_commands(sub) -> None:
    ck = sub.add_parser("checkpoint", help="look into checkpoints")
    ck_sub = ck.add_subparsers(dest="checkpoint_command", required=True)
    inspect = ck_sub.add_parser("inspect", help="a checkpoint's step, layout, size, model and data position")
    inspect.add_argument("path", help="a step_N folder, or a checkpoint.dir holding them")
    inspect.add_argument("--tensors", action="store_true", help="list every tensor and its whole shape")


def run_checkpoint_command(args) -> int:
    from tessera.checkpoint import dcp, store

    paths = [args.path] if store.is_checkpoint(args.path) else [p for _, p in store.checkpoints(args.path)]
    if not paths:
        print(f"tessera: {args.path} is neither a checkpoint (step_N with tessera.json and .metadata) nor a "
              "folder holding one", file=sys.stderr)
        return 2
    status = 0
    for path in paths:
        try:
            meta = store.read_meta(path)
            store.check_files(path)
        except store.DamagedCheckpoint as e:
            print(f"{os.path.normpath(path)}: damaged: {e}")
            status = 1
            continue
        tensors = dcp.saved_tensors(path)
        model = meta["config"]["model"]
        params = sum(math.prod(md.size) for key, md in tensors.items() if key.startswith("model."))
        layout = " ".join(f"{k}={v}" for k, v in meta["layout"].items())
        print(f"{os.path.normpath(path)}: step {meta['step']}, saved {meta['saved']} at {layout}, "
              f"{store.folder_gib(path):.2f} GiB")
        print(f"  model: {model['family']}, {params:,} parameters, layers={model['layers']} hidden={model['hidden']} "
              f"heads={model['heads']} vocab_size={model['vocab_size']} seq_len={model['seq_len']}")
        print(f"  data: {meta['batches']['consumed_samples']:,} samples consumed; schedule decays until step "
              f"{meta['scheduler']['settings']['decay_end']}; Adam step {meta['adam_step']:g}"
              + (f"; fp16 loss scale {meta['scaler']['scale']:g}" if meta.get("scaler") else ""))
        if args.tensors:
            for key in sorted(tensors):
                print(f"  {key} {list(tensors[key].size)}")
    return status
