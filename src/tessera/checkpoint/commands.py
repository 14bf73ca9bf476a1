"""``tessera checkpoint inspect PATH``: what a checkpoint holds, without loading it.
``tessera checkpoint export PATH --hf OUT``: its weights as a transformers model folder.
``tessera checkpoint export PATH --megatron OUT``: as a Megatron-Core distributed checkpoint
(checkpoint/megatron.py), which megatron-core's ``dist_checkpointing.load`` reads.
``tessera checkpoint import --megatron DIR --out OUT``: a Megatron-Core distributed checkpoint as
a tessera checkpoint ``OUT/step_<iteration>`` a run resumes from (its step and consumed samples;
Adam's moments start at zero).
``tessera checkpoint import HF_FOLDER --out DIR``: a transformers GPT-2 or Llama folder as a
weights-only checkpoint ``DIR/step_00000000`` (with the folder's tokenizer.json and end-of-sequence
ids, for ``tessera generate``), which a run starts from with
``checkpoint.load=DIR/step_00000000 checkpoint.finetune=true`` and the model settings it prints
(the folder itself, not DIR: DIR may hold other checkpoints, and a folder means its newest).

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
    export = ck_sub.add_parser("export", help="a checkpoint's weights as a Hugging Face transformers model folder "
                               "or a Megatron-Core distributed checkpoint")
    export.add_argument("path", help="a step_N folder, or a checkpoint.dir (its newest)")
    target = export.add_mutually_exclusive_group(required=True)
    target.add_argument("--hf", metavar="OUT", help="the folder to write config.json and model.safetensors to")
    target.add_argument("--megatron", metavar="OUT", help="the folder to write latest_checkpointed_iteration.txt and "
                        "iter_NNNNNNN/ (torch_dist) to")
    export.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default="fp32", help="the weights' dtype (default fp32)")
    export.add_argument("--tokenizer", metavar="JSON", help="the tokenizer.json to put beside the weights (default: "
                        "the checkpoint's own, the run's train.sample_tokenizer, else the data's PREFIX.tokenizer.json, "
                        "where there is one; the builtin corpus's bytes as a tokenizer.json of the same ids)")
    imp = ck_sub.add_parser("import", help="a transformers GPT-2 or Llama folder as a weights-only checkpoint, or a "
                            "Megatron-Core distributed checkpoint as one a run resumes from")
    source = imp.add_mutually_exclusive_group(required=True)
    source.add_argument("folder", nargs="?", help="config.json and model.safetensors (or its index of several files)")
    source.add_argument("--megatron", metavar="DIR", help="a Megatron-LM checkpoint folder (--save) or one of its "
                        "iter_NNNNNNN folders, torch_dist format")
    imp.add_argument("--out", required=True, metavar="DIR", help="writes DIR/step_00000000 (Megatron: DIR/step_<iteration>)")
    imp.add_argument("--tokenizer", metavar="JSON", help="Megatron: the tokenizer.json its data was made with, "
                     "checked against the vocabulary and kept beside the weights")


def run_checkpoint_command(args) -> int:
    try:
        if args.checkpoint_command == "export":
            return _export_megatron(args) if args.megatron else _export(args)
        if args.checkpoint_command == "import":
            return _import_megatron(args) if args.megatron else _import(args)
    except (ValueError, OSError) as e:
        print(f"tessera: checkpoint {args.checkpoint_command}: {e}", file=sys.stderr)
        return 2
    return _inspect(args)


def _checkpoint_path(given: str) -> str:
    from tessera.checkpoint import store

    path = given if store.is_checkpoint(given) else next(iter(p for _, p in store.checkpoints(given)[-1:]), None)
    if path is None:
        raise ValueError(f"{given} is neither a checkpoint nor a folder holding one")
    store.check_files(path)
    return path


def _export_megatron(args) -> int:
    import torch

    from tessera.checkpoint import dcp, megatron, store
    from tessera.config import ModelConfig

    path = _checkpoint_path(args.path)
    meta = store.read_meta(path)
    model = ModelConfig(**meta["config"]["model"])
    whole = {k.removeprefix("model."): v for k, v in dcp.read_whole(path).items()}
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    state = {k: v.to(dtype) for k, v in megatron.to_megatron(whole, model).items()}
    train, optim = meta["config"].get("train", {}), meta["config"].get("optim", {})
    consumed = meta["batches"]["consumed_samples"]
    more = megatron.run_args(train, optim, consumed) | {"params_dtype": dtype, "bf16": args.dtype == "bf16",
                                                         "fp16": args.dtype == "fp16"}
    common = {"iteration": meta["step"], "checkpoint_version": 3.0, "args": megatron.megatron_args(model, **more),
              "num_floating_point_operations_so_far": 0}
    folder = megatron.write_megatron(args.megatron, meta["step"], state, common)
    print(f"tessera: wrote {path}'s weights to {folder} (Megatron-Core torch_dist, {model.family}, {args.dtype}, "
          f"iteration {meta['step']}, {consumed:,} samples consumed); no optimizer or random state: load it with "
          "Megatron-LM's --no-load-optim --no-load-rng")
    return 0


def _import_megatron(args) -> int:
    from tessera.checkpoint import megatron
    from tessera.checkpoint.vocabulary import TOKENIZER
    from tessera.config import ModelConfig

    folder = megatron.iteration_folder(args.megatron)
    common = megatron.read_common(folder)
    state = megatron.read_tensors(folder)
    settings = megatron.model_settings(common["args"], {k: tuple(v.shape) for k, v in state.items()})
    megatron.check_vocabulary(settings["vocab_size"], args.tokenizer)
    whole = megatron.from_megatron(state, ModelConfig(**settings))
    run = megatron.run_settings(common["args"])
    iteration = int(common.get("iteration", 0))
    consumed = int(getattr(common["args"], "consumed_train_samples", 0) or 0)
    path = megatron.write_tessera(args.out, whole, settings, run, iteration, consumed,
                                  files={TOKENIZER: args.tokenizer} if args.tokenizer else None)
    flags = " ".join(f"--set {section}.{k}={str(v).lower() if isinstance(v, bool) else v}"
                     for section, values in (("model", settings), ("train", run["train"]), ("optim", run["optim"]))
                     for k, v in values.items() if not (section == "train" and k == "steps"))
    print(f"tessera: wrote {path} ({settings['family']}, {sum(t.numel() for t in whole.values()):,} parameters, "
          f"iteration {iteration}, {consumed:,} samples consumed)\n"
          "optimizer state not imported: Adam moments start at zero\n"
          f"resume from it with: --set checkpoint.load={path} {flags} --set train.steps=<at least {iteration}> "
          + (f" --set data.source=indexed --set data.paths={','.join(run['data']['paths'])} --set data.split="
             f"{run['data']['split']} (the data Megatron trained on, as it named it)" if run["data"]["source"] == "indexed"
             else " and the data settings Megatron trained with (data.paths, data.split)")
          + ("" if run["optim"] else "\n(its args hold no learning-rate schedule: add --set checkpoint.new_schedule=true "
             "and the run's optim settings)"))
    return 0


def _export(args) -> int:
    import torch

    from tessera.checkpoint import dcp, hf, store
    from tessera.checkpoint.vocabulary import vocabulary
    from tessera.config import ModelConfig

    path = args.path if store.is_checkpoint(args.path) else next(iter(p for _, p in store.checkpoints(args.path)[-1:]), None)
    if path is None:
        raise ValueError(f"{args.path} is neither a checkpoint nor a folder holding one")
    store.check_files(path)
    model = ModelConfig(**store.read_meta(path)["config"]["model"])
    whole = {k.removeprefix("model."): v for k, v in dcp.read_whole(path).items()}
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    config = hf.hf_config(model) | {"dtype": {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[args.dtype]}
    meta = store.read_meta(path)
    vocab = vocabulary(path, meta, args.tokenizer)
    tokenizer = vocab.file
    if tokenizer:
        from tokenizers import Tokenizer
        ids = Tokenizer.from_file(tokenizer).get_vocab_size(with_added_tokens=True)
        if ids > model.vocab_size:
            raise ValueError(f"the tokenizer {tokenizer} has {ids} ids, the model {model.vocab_size}: "
                             "give the tokenizer the run's data was made with (--tokenizer)")
    eod = vocab.stop_ids[0] if vocab.stop_ids and (tokenizer or vocab.byte_tokens) else None
    if eod is not None:
        config |= {"eos_token_id": eod, "bos_token_id": eod}
    hf.write_hf_folder(args.hf, config, {k: v.to(dtype) for k, v in hf.to_hf(whole, model).items()})
    if vocab.byte_tokens:  # the builtin corpus's bytes, as a tokenizer.json of the same ids
        from tessera.data.tokenizer import ByteTokenizer

        tokenizer = os.path.join(args.hf, "tokenizer.json")
        with open(tokenizer, "w") as f:
            f.write(ByteTokenizer.hf_json())
        hf.write_hf_tokenizer(args.hf, tokenizer, None, model.seq_len)  # (eos: config.json's eos_token_id)
    elif tokenizer:
        hf.write_hf_tokenizer(args.hf, tokenizer, eod, model.seq_len)
    where = "byte tokens" if vocab.byte_tokens else f"its tokenizer from {tokenizer}"
    print(f"tessera: wrote {path}'s weights to {args.hf} ({config['architectures'][0]}, {args.dtype}); "
          + (where + (f" (end of document: id {eod})" if eod is not None else "")
             if tokenizer else f"no tokenizer ({vocab.missing}: give --tokenizer)"))
    return 0


def _import(args) -> int:
    from tessera.checkpoint import hf, store
    from tessera.checkpoint.vocabulary import TOKENIZER
    from tessera.config import ModelConfig

    config, state = hf.read_hf_folder(args.folder)
    settings = hf.model_settings(config)
    whole = hf.from_hf(state, ModelConfig(**settings))
    tokenizer = os.path.join(args.folder, TOKENIZER)  # (generation reads it from the checkpoint)
    files = {TOKENIZER: tokenizer} if os.path.isfile(tokenizer) else {}
    stops = hf.stop_ids(args.folder, config, settings["vocab_size"])
    path = store.write_weights(args.out, whole, settings, files=files, meta={"stop_ids": stops} if stops else {})
    shown = {k: v for k, v in settings.items() if not (k == "seq_len" and settings["family"] == "llama")}
    flags = " ".join(f"--set model.{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in shown.items())
    print(f"tessera: wrote {path} ({settings['family']}, {sum(t.numel() for t in whole.values()):,} parameters)\n"
          f"start a run from it with: --set checkpoint.load={path} --set checkpoint.finetune=true {flags}"
          + ("\n(model.seq_len is the run's own choice: RoPE has no per-position weights; the model was "
             f"trained with up to {settings['seq_len']} positions)" if settings["family"] == "llama" else ""))
    return 0


def _inspect(args) -> int:
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
        if meta.get("contents") == "weights":
            print("  weights only (imported): a run starts from it with checkpoint.finetune=true")
        else:
            print(f"  data: {meta['batches']['consumed_samples']:,} samples consumed; schedule decays until step "
                  f"{meta['scheduler']['settings']['decay_end']}; Adam step {meta['adam_step']:g}"
                  + (f"; fp16 loss scale {meta['scaler']['scale']:g}" if meta.get("scaler") else ""))
        if args.tensors:
            for key in sorted(tensors):
                print(f"  {key} {list(tensors[key].size)}")
    return status
