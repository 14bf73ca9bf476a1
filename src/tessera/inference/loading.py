"""A checkpoint opened for generation and evaluation: its folder, the configuration (the saved
model, the layout from ``--set``), this rank's model chunks with the saved weights, and the
tokenizer.

Any checkpoint loads into any layout: each rank builds its chunks (tp, pp, vpp) and reads the
boxes of the whole tensors it holds (checkpoint/shards.py's ``model_shards``, resharded by
torch.distributed.checkpoint), a training run's (fp32 main parameters, Adam's moments left
unread) or an imported transformers model's alike. Every refusal is a ``ConfigError`` naming
the flag or key at fault and the fix, before any process group or model exists.
"""

from __future__ import annotations

import os

import torch

from tessera.checkpoint import dcp, store
from tessera.checkpoint.shards import model_shards
from tessera.checkpoint.vocabulary import Vocabulary, vocabulary
from tessera.config import Config, ConfigError, build_config, check, parse_overrides
from tessera.models import GPTModel, TPContext
from tessera.pipeline_parallel.stage import LayoutError, build_stage_chunks, parse_layout, stage_layer_ranges
from tessera.topology import Topology

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def find_checkpoint(path: str) -> tuple[str, dict]:
    """(the step_N folder, its ``tessera.json``) of ``--checkpoint`` (a step_N folder, or a folder
    of them: its newest)."""
    fix = ("give a step_N folder a run saved (checkpoint.dir/step_N), a folder holding them, or one "
           "`tessera checkpoint import` wrote")
    found = path if store.is_checkpoint(path) else next(iter(p for _, p in store.checkpoints(path)[-1:]), None)
    if found is None:
        why = "does not exist" if not os.path.exists(path) else "is neither a checkpoint nor a folder holding one"
        if os.path.isfile(os.path.join(path, "config.json")):
            fix = f"a transformers folder becomes a checkpoint with `tessera checkpoint import {path} --out DIR`"
        raise ConfigError("--checkpoint", f"{path} {why}", fix)
    try:
        meta = store.read_meta(found)
        store.check_files(found)
    except store.DamagedCheckpoint as e:
        raise ConfigError("--checkpoint", f"the checkpoint {found} is damaged: {e}", "give a whole checkpoint") from None
    return found, meta


def inference_config(meta: dict, overrides: list[str]) -> Config:
    """The checkpoint's model and data settings (and seed: the data's order) with ``--set``
    overrides (the layout: parallel.tp, pp, vpp, sequence_parallel; train.device, dtype,
    timeout_s; data.* for ``eval``). The model is the checkpoint's: a model.* override is refused."""
    given = parse_overrides(overrides)
    for key in given.get("model", {}):
        raise ConfigError(f"model.{key}", "the model is the checkpoint's (its tessera.json)",
                          f"leave model.{key} out: generation and evaluation load the saved model")
    saved = meta["config"]
    values = {"model": dict(saved["model"]), "data": dict(saved.get("data", {}))}
    if "seed" in saved.get("train", {}):  # (the data's order: eval reads the samples the run read)
        values["train"] = {"seed": saved["train"]["seed"]}
    for section, table in given.items():
        values.setdefault(section, {}).update(table)
    return build_config(values)


def check_layout(cfg: Config, world_size: int) -> Config:
    """The layout's sizes against the model and the world size; returns ``cfg`` with
    ``parallel.dp`` resolved (the ranks left: replicas that share the prompts or samples)."""
    p, m = cfg.parallel, cfg.model
    check(p.cp == 1, "parallel.cp", f"{p.cp}: generation and evaluation run whole sequences",
          "set parallel.cp=1 (further ranks become data-parallel replicas)")
    check(world_size % (p.tp * p.pp) == 0, "parallel.tp", f"tp*pp = {p.tp}*{p.pp} does not divide the world size "
          f"{world_size}", f"launch a multiple of {p.tp * p.pp} processes, or change parallel.tp / parallel.pp")
    dp = world_size // (p.tp * p.pp)
    check(p.dp in (0, dp), "parallel.dp", f"{p.dp} is not the world size {world_size} / (tp*pp)",
          "set parallel.dp=0 to derive it")
    for key, n in (("heads", m.heads), ("kv_heads", m.num_kv_heads), ("ffn_hidden", m.ffn_size)):
        check(n % p.tp == 0, f"model.{key}" if key != "heads" else "parallel.tp",
              f"the model's {key} = {n} is not divisible by tp={p.tp}", "choose a tp that divides it")
    check(not p.sequence_parallel or (p.tp > 1 and m.seq_len % p.tp == 0), "parallel.sequence_parallel",
          f"needs tp > 1 and model.seq_len ({m.seq_len}) divisible by tp={p.tp}", "turn it off")
    check(p.vpp == 1 or p.pp > 1, "parallel.vpp", "vpp > 1 needs pp >= 2", "set parallel.vpp=1 or parallel.pp >= 2")
    try:
        stage_layer_ranges(m.layers, p.pp, p.vpp, parse_layout(p.pp_layout, m, p.pp, p.vpp))
    except LayoutError as e:
        raise ConfigError("parallel.pp", str(e), f"use fewer stages than the model's {m.layers} layers, or set "
                          "parallel.pp_layout") from None
    p.dp = dp
    return cfg


@torch.no_grad()
def load_chunks(cfg: Config, topo: Topology, path: str) -> list[GPTModel]:
    """This rank's model chunks with the checkpoint's weights, in ``train.dtype``, in eval mode.
    Collective: every rank calls it."""
    p = cfg.parallel
    llama_on_gpu = cfg.model.family == "llama" and topo.device.type == "cuda"
    tp = TPContext(group=topo.group("tp"), sequence_parallel=p.sequence_parallel, fused_elementwise=llama_on_gpu)
    chunks = build_stage_chunks(cfg.model, tp, topo.pp_rank, p.pp, p.vpp,
                                parse_layout(p.pp_layout, cfg.model, p.pp, p.vpp), topo.device)
    for chunk in chunks:
        for param in chunk.parameters():
            param.zero_()  # (the vocabulary's padding rows stay zero: never looked up nor predicted)
    try:
        dcp.read(path, model_shards(chunks, cfg.model.vocab_size, topo.tp_rank), {})
    except dcp.CheckpointMismatch as e:
        raise ConfigError("--checkpoint", f"{path} does not hold the model its tessera.json describes ({e})",
                          "give a whole checkpoint") from None
    for chunk in chunks:
        chunk.to(DTYPES[cfg.train.dtype]).eval()
    return chunks


def checkpoint_vocabulary(path: str, meta: dict, given: str | None) -> Vocabulary:
    """The checkpoint's tokenizer and end-of-document ids (checkpoint/vocabulary.py), refused where
    there is none or it has more ids than the model."""
    try:
        vocab = vocabulary(path, meta, given)
    except ValueError as e:
        raise ConfigError("--tokenizer", str(e), "give a tokenizer.json, or a folder holding one") from None
    if vocab.file is None and not vocab.byte_tokens:
        raise ConfigError("--tokenizer", f"no tokenizer for {path}: {vocab.missing}",
                          "give --tokenizer FILE (the tokenizer.json the model's data was made with)")
    return vocab


def open_tokenizer(vocab: Vocabulary, vocab_size: int):
    """The tokenizer object (``encode``, ``decode``) of a :class:`Vocabulary`."""
    from tessera.data.tokenizer import ByteTokenizer, file_tokenizer

    tokenizer = ByteTokenizer() if vocab.byte_tokens else file_tokenizer(
        vocab.file, "--tokenizer", "give the tokenizer.json the model's data was made with")
    if tokenizer.vocab_size > vocab_size:
        raise ConfigError("--tokenizer", f"{vocab.file} has {tokenizer.vocab_size} ids, the model {vocab_size}",
                          "give the tokenizer the model's data was made with")
    return tokenizer


__all__ = ["find_checkpoint", "inference_config", "check_layout", "load_chunks", "checkpoint_vocabulary",
           "open_tokenizer", "DTYPES"]
