"""Checkpoints on disk: one folder per saved step, visible only once complete; what a run
resumes from.

    checkpoint.dir/
      step_00000200/            a complete checkpoint: renamed into place after every rank wrote
        .metadata               DCP's index: each tensor's whole shape and the boxes saved
        __0_0.distcp ...        each rank's boxes (checkpoint/shards.py) and objects
        tessera.json            the step, the run's config, the scheduler's, batch calculator's
                                and loss scaler's state, Adam's step count, every other file's
                                CRC-32 (checkpoint/checksums.py) (written last)
      step_00000300.partial/    a save in progress, or one that died: never read, replaced by
                                the next save of that step

Saving writes ``step_N.partial``, then rank 0 writes ``tessera.json`` into it and renames it to
``step_N`` (an atomic rename on a POSIX file system): a crash at any point leaves either the
whole checkpoint or none, and the older ones untouched. Every rank must see the same file
system at ``checkpoint.dir`` (a shared one across nodes).

A run starts from the newest checkpoint in ``checkpoint.dir`` (its own progress: a restarted
job resumes by itself, with the same command), else from ``checkpoint.load`` (a ``step_N``
folder, or a folder of them: its newest; e.g. a pretrained model a fine-tune starts from), else
from scratch. :func:`check_resume` refuses, before any process starts, a checkpoint whose model
differs from the config's, whose batch sizes or learning-rate schedule differ (the resumed run
would silently change them; not with ``checkpoint.finetune``, which takes the weights only, nor
the schedule with ``checkpoint.new_schedule``), a ``checkpoint.load`` naming an older checkpoint of
``checkpoint.dir`` (a run from it would replace the later ones), and a damaged checkpoint: a data
file missing or cut short, or a ``tessera.json`` whose model disagrees with the tensors (a data
file of the right size but other bytes fails its checksum as the load starts: the checkpointer). The layout (tp, pp, vpp, dp,
zero) and the dtype may differ: loading reshards.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import shutil

from tessera.checkpoint import files
from tessera.config import Config, ConfigError, ModelConfig

META = "tessera.json"
FORMAT = 1
_NAME = re.compile(r"step_(\d+)$")
# the model settings a checkpoint's tensors depend on (the others, e.g. dropout, may change)
_MODEL_KEYS = ("family", "vocab_size", "hidden", "layers", "heads", "num_kv_heads", "ffn_size", "tie_embeddings",
               "norm_eps", "rope_theta", "gelu")


def step_dir(root: str, step: int) -> str:
    return files.join(root, f"step_{step:08d}")


def is_checkpoint(path: str) -> bool:
    return files.isfile(files.join(path, META)) and files.isfile(files.join(path, ".metadata"))


def checkpoints(root: str) -> list[tuple[int, str]]:
    """The complete checkpoints in ``root``, (step, folder), oldest first."""
    found = []
    for name in files.listdir(root):
        match = _NAME.match(name)
        path = files.join(root, name)
        if match and is_checkpoint(path):
            found.append((int(match.group(1)), path))
    return sorted(found)


class DamagedCheckpoint(ValueError):
    """A complete-looking checkpoint whose files are not whole (changed after it was saved)."""


def read_meta(path: str) -> dict:
    try:
        with files.open_file(files.join(path, META), "rb") as f:
            meta = json.loads(f.read())
        for key in ("step", "adam_step", "batches", "scheduler", "layout", "config"):
            meta[key]  # noqa: B018 -- present, or the file is not one tessera wrote whole
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DamagedCheckpoint(f"its {META} is unreadable ({type(e).__name__}: {e})") from None
    if meta.get("format") != FORMAT:
        raise ConfigError("checkpoint.load", f"{path} is in checkpoint format {meta.get('format')!r}, "
                          f"this tessera reads format {FORMAT}", "load it with the tessera version that saved it")
    return meta


def check_files(path: str) -> None:
    """Every data file DCP's index names exists and is long enough for what it says is in it
    (a checkpoint copied in part, or cut short, is found here rather than mid-load)."""
    from tessera.checkpoint.dcp import storage_extents

    try:
        extents = storage_extents(path)
    except Exception as e:  # noqa: BLE001 -- whatever DCP raises on a broken index
        raise DamagedCheckpoint(f"its index .metadata is unreadable ({type(e).__name__}: {e})") from None
    for name, end in sorted(extents.items()):
        file = files.join(path, name)
        if not files.isfile(file):
            raise DamagedCheckpoint(f"{name} is missing")
        if files.size(file) < end:
            raise DamagedCheckpoint(f"{name} holds {files.size(file):,} bytes, its index says {end:,}")


def check_tensors(path: str, model: ModelConfig) -> None:
    """The tensors of the model ``tessera.json`` describes are in the checkpoint with their whole
    shapes (a ``tessera.json`` edited, or copied from another checkpoint, is found here, not as a
    mismatch deep inside the load)."""
    from tessera.checkpoint import dcp

    try:
        saved = {key: tuple(md.size) for key, md in dcp.saved_tensors(path).items()}
    except Exception as e:  # noqa: BLE001 -- whatever DCP raises on a broken index
        raise DamagedCheckpoint(f"its index .metadata is unreadable ({type(e).__name__}: {e})") from None
    for key, shape in whole_shapes(model).items():
        if saved.get(key, shape) != shape or key not in saved:
            there = f"{list(saved[key])} in .metadata" if key in saved else "absent from .metadata"
            raise DamagedCheckpoint(f"its {META} disagrees with its tensors: {META}'s model (layers={model.layers}, "
                                    f"hidden={model.hidden}, vocab_size={model.vocab_size}, ...) has {key} of shape "
                                    f"{list(shape)}, {there}")


def whole_shapes(model: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The checkpoint keys and whole shapes of a ``model``'s parameters (checkpoint/shards.py:
    a one-process model's, the vocabulary unpadded); on the meta device, no memory."""
    import torch

    from tessera.checkpoint.shards import placements
    from tessera.models import GPTModel

    with torch.device("meta"):
        chunk = GPTModel(model)
    return {"model." + p.key: tuple(p.shape) for p in placements(chunk, model.vocab_size, 0).values()}


def damaged(cfg: Config, path: str, why: str) -> ConfigError:
    """The refusal of a damaged checkpoint: checkpoint.dir's own (where a run goes on from) or
    checkpoint.load's, with the fix for each."""
    own = bool(cfg.checkpoint.dir) and files.same_place(files.parent(path), cfg.checkpoint.dir)
    return ConfigError("checkpoint.dir" if own else "checkpoint.load", f"the checkpoint {path} is damaged: {why}",
                       "move it out of the way (a run then starts from the one before), or restore it"
                       if own else "give a whole checkpoint, or restore this one")


def write_meta(path: str, meta: dict) -> None:
    """``tessera.json`` in ``path``, whole or not at all (a temporary renamed over it)."""
    saved = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    files.write_whole(files.join(path, META), json.dumps({"format": FORMAT, "saved": saved, **meta}, indent=1).encode())


def resume_path(cfg: Config) -> str | None:
    """The checkpoint this run starts from, or None (from scratch): checkpoint.dir's newest (the
    run's own progress: a restarted job goes on from it), else checkpoint.load (where a new run
    starts: a step folder, or a folder of them and its newest)."""
    c = cfg.checkpoint
    own = checkpoints(c.dir) if c.dir else []
    if c.load and own and files.same_place(files.parent(c.load), c.dir) and is_checkpoint(c.load) \
            and not files.same_place(c.load, own[-1][1]):
        raise ConfigError("checkpoint.load", f"{c.load} is an older checkpoint of checkpoint.dir, whose newest is "
                          f"{files.basename(own[-1][1])}: a run resumes from the newest (saving from an older one "
                          "would replace the later ones)",
                          "to go back to it, move the later step_N folders out of checkpoint.dir, or give another "
                          "checkpoint.dir")
    if own:
        return own[-1][1]
    if not c.load:
        return None
    if is_checkpoint(c.load):
        return c.load
    found = checkpoints(c.load)
    if found:
        return found[-1][1]
    why = "does not exist" if not files.exists(c.load) else "is neither a checkpoint nor a folder holding one"
    hf = files.isfile(files.join(c.load, "config.json"))  # (a transformers folder)
    raise ConfigError("checkpoint.load", f"{c.load} {why}",
                      "give a step_N folder written by a run (checkpoint.dir/step_N), or a folder holding them"
                      + (f"; a Hugging Face folder becomes one with `tessera checkpoint import {c.load} --out DIR`"
                         if hf else ""))


def check_resume(cfg: Config) -> dict | None:
    """The checkpoint this run starts from, checked against the config (see the module's
    docstring); its ``tessera.json``, or None."""
    from tessera.optim import LRScheduler, MicroBatchCalculator

    path = resume_path(cfg)
    c = cfg.checkpoint
    if c.dir and not files.is_url(c.dir) and os.path.exists(c.dir) and not os.path.isdir(c.dir):
        raise ConfigError("checkpoint.dir", f"{c.dir} is a file", "give a folder for the checkpoints")
    if path is None:
        return None
    own = bool(c.dir and checkpoints(c.dir))  # the run's own progress, which goes before checkpoint.load
    try:
        meta = read_meta(path) | {"path": path}
        check_files(path)
        check_tensors(path, ModelConfig(**meta["config"]["model"]))
    except DamagedCheckpoint as e:
        raise damaged(cfg, path, str(e)) from None
    # weights only: from checkpoint.load (not the run's own checkpoints) with checkpoint.finetune
    meta["weights_only"] = c.finetune and not own
    if meta.get("contents") == "weights" and not meta["weights_only"]:
        raise ConfigError("checkpoint.finetune", f"{path} holds a model's weights only (imported), no training state "
                          "to go on from", "start a run from its weights with checkpoint.load=<it> "
                          "checkpoint.finetune=true" + (", and another checkpoint.dir (this one's own newest is where "
                          "a run resumes from)" if own else ""))
    saved = ModelConfig(**meta["config"]["model"])
    for key in _MODEL_KEYS:
        if key == "rope_theta" and saved.family != "llama":
            continue  # (GPT-2 has learned positions)
        mine, theirs = getattr(cfg.model, key), getattr(saved, key)
        if mine != theirs:
            name = {"num_kv_heads": "kv_heads", "ffn_size": "ffn_hidden"}.get(key, key)
            raise ConfigError(f"model.{name}", f"the checkpoint {path} was saved with {name} = {theirs}, "
                              f"this run's model has {mine}", f"set model.{name}={theirs} to load it")
    if saved.family == "gpt2" and saved.seq_len != cfg.model.seq_len:  # learned positions: one row each
        raise ConfigError("model.seq_len", f"the checkpoint {path} has {saved.seq_len} learned positions, "
                          f"this run's model {cfg.model.seq_len}", f"set model.seq_len={saved.seq_len} to load it")
    if meta["weights_only"]:
        return meta
    step = meta["step"]
    if cfg.train.steps < step:
        fix = f"set train.steps >= {step} to train on from it"
        fix += (", or checkpoint.finetune=true to start a new run from its weights" if not own else
                f" (it is checkpoint.dir's own newest, which a run goes on from; to start a new run from its weights, "
                f"give another checkpoint.dir with checkpoint.load={path} and checkpoint.finetune=true)")
        raise ConfigError("train.steps", f"{cfg.train.steps}, but the checkpoint {path} is at step {step}", fix)
    # the data's order: a resume with another seed, split or order would reshuffle it mid-run (and a
    # new split could hand documents already trained on to the validation set)
    saved_train, saved_data = meta["config"].get("train", {}), meta["config"].get("data", {})
    same_data = all(saved_data.get(k, getattr(cfg.data, k)) == getattr(cfg.data, k) for k in ("source", "paths"))
    split = saved_data.get("split") if same_data and cfg.data.source != "synthetic" else None
    if split is not None and _proportions(split) == _proportions(cfg.data.split):
        split = None  # (2,0,0 is 1,0,0: the same documents)
    # (checkpoints from before data.sample_order were trained in the per-epoch order)
    order = saved_data.get("sample_order", "epochs") if same_data and cfg.data.source != "synthetic" else None
    for key, mine, theirs in (("train.seed", cfg.train.seed, saved_train.get("seed")),
                              ("data.split", cfg.data.split, split),
                              ("data.sample_order", cfg.data.sample_order, order)):
        if theirs is not None and mine != theirs:
            raise ConfigError(key, f"the checkpoint {path} was trained with {key}={theirs}, this run has {mine}: "
                              "the data would be reshuffled mid-run", f"set {key}={theirs} to resume (or start a new "
                              "run from its weights with checkpoint.finetune=true)")
    MicroBatchCalculator.from_config(cfg.train, cfg.parallel.dp).load_state_dict(meta["batches"])
    if not c.new_schedule:
        try:
            LRScheduler(cfg.optim, cfg.train.steps).load_state_dict(meta["scheduler"])
        except ConfigError as e:
            raise ConfigError(e.key, e.problem, f"{e.fix}, or set checkpoint.new_schedule=true to resume with "
                              "this run's schedule") from None
    return meta


def _proportions(split: str) -> list[float] | str:
    """A data.split's weights as fractions (the documents each part gets depend on these only)."""
    from tessera.data.indices import parse_split

    try:
        return parse_split(split)
    except ValueError:
        return split


def write_weights(root: str, whole: dict, model: dict, files: dict[str, str] | None = None,
                  meta: dict | None = None) -> str:
    """A weights-only checkpoint ``root/step_00000000`` of the whole tensors ``whole`` (names as
    a one-process model's, fp32) for a model of the ``model`` settings (one process, e.g. an
    import from transformers); a run starts from it with ``checkpoint.finetune=true``. ``files``:
    name -> a file copied in beside the tensors (an import's tokenizer.json); ``meta``: more
    entries of its ``tessera.json`` (an import's end-of-sequence ids)."""
    from tessera.checkpoint import dcp
    from tessera.checkpoint.shards import Shard
    from tessera.config import Config, to_dict

    from tessera.checkpoint.checksums import checksums, written_by

    partial = begin_save(root, 0)
    shards = [Shard("model." + name, tuple(t.shape), (0,) * t.ndim, t.float()) for name, t in whole.items()]
    dcp.write(partial, shards, {})
    for name, source in (files or {}).items():
        shutil.copyfile(source, os.path.join(partial, name))
    config = to_dict(Config(model=ModelConfig(**model)))
    return finish_save(partial, {"checksums": checksums(partial, written_by(partial, 0, 1)), "contents": "weights", "step": 0, "adam_step": 0.0,
                                 "batches": {"consumed_samples": 0, "batches": []},
                                 "scheduler": {"settings": {"decay_end": 0}}, "scaler": None,
                                 "layout": {"tp": 1, "pp": 1, "dp": 1, "vpp": 1, "zero": 0, "dtype": "fp32"},
                                 "config": config} | (meta or {}), keep=0)


def folder_gib(path: str) -> float:
    """The size of a checkpoint's files."""
    return files.folder_bytes(path) / 2**30


def begin_save(root: str, step: int) -> str:
    """Rank 0: the empty folder a save writes into: ``step_N.partial``, or in an object store
    ``step_N`` itself (checkpoint/files.py), a dead save's leftovers there removed first."""
    if files.is_url(root):
        final = step_dir(root, step)
        if is_checkpoint(final):  # (check_resume refuses a checkpoint.dir with later steps than the run's)
            raise FileExistsError(f"{final} exists: a checkpoint is never replaced")
        files.remove_tree(final)
        return final
    partial = step_dir(root, step) + ".partial"
    shutil.rmtree(partial, ignore_errors=True)
    os.makedirs(partial)
    return partial


def finish_save(partial: str, meta: dict, keep: int) -> str:
    """Rank 0, after every rank wrote: ``tessera.json``, the rename that makes the checkpoint
    visible, then the oldest beyond ``keep`` (0: keep all) removed."""
    write_meta(partial, meta)  # (in an object store, the commit: the checkpoint is whole from here)
    final = partial.removesuffix(".partial")
    if final != partial:
        if os.path.exists(final):  # (check_resume refuses a checkpoint.dir with later steps than the run's)
            raise FileExistsError(f"{final} exists: a checkpoint is never replaced")
        os.replace(partial, final)
    root = files.parent(final)
    if keep:
        for _, old in checkpoints(root)[:-keep]:
            files.remove_tree(old, marker=META)
    return final


__all__ = ["checkpoints", "check_resume", "folder_gib", "write_weights", "resume_path", "read_meta", "step_dir", "begin_save", "finish_save"]
