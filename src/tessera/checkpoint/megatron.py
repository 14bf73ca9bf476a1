"""Megatron-Core distributed checkpoints (the ``torch_dist`` format) in and out.

A Megatron-LM checkpoint folder holds ``latest_checkpointed_iteration.txt`` and ``iter_NNNNNNN/``
with DCP's ``.metadata`` and ``__*.distcp`` files, ``common.pt`` (the iteration and Megatron-LM's
``args``, among them ``consumed_train_samples``) and ``metadata.json``. DCP holds every tensor
whole with the boxes each rank saved, whatever TP / PP it was saved at, so one process reads
the whole tensors. A decoder's layers are stacked: ``decoder.layers.mlp.linear_fc1.weight`` is
``[layers, ...]``. Norm weights carry Transformer Engine's fused names
(``self_attention.linear_qkv.layer_norm_weight``) with the local spec too; the local names
(``input_layernorm``, ``pre_mlp_layernorm``) are read as well.

Layouts (Megatron's against tessera's whole tensors, checkpoint/shards.py):

- ``linear_qkv``: per query group g, [the group's query heads; k_g; v_g] rows
  (megatron/core/transformer/attention.py splits it so); tessera's ``attn.qkv`` is
  [all q; all k; all v]. Regrouped both ways, exactly (rows moved, no arithmetic).
- ``linear_fc1`` with a gated linear unit: [gate; up], as tessera's ``mlp.fc1``.
- GPT: LayerNorm with biases, learned positions, GELU (exact, or tanh with ``--openai-gelu``:
  tessera's ``model.gelu``), tied or not;
  Llama: RMSNorm, RoPE (rotate-half), SwiGLU, GQA, no biases. Anything else Megatron builds
  (MoE, MLA, other norms or activations, QK norms) is refused, never dropped.

The vocabulary is Megatron's padded one (the embedding's rows): tessera's ``model.vocab_size``
becomes it, so its loss is taken over the same columns as Megatron's.
"""

from __future__ import annotations

import argparse
import json
import os
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch import Tensor
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from tessera.config import ModelConfig

LATEST = "latest_checkpointed_iteration.txt"
COMMON = "common.pt"

# tessera's per-layer name -> Megatron's (under decoder.layers., stacked over the layers)
_LAYER = {"attn_norm.weight": "self_attention.linear_qkv.layer_norm_weight",
          "attn_norm.bias": "self_attention.linear_qkv.layer_norm_bias",
          "attn.qkv.weight": "self_attention.linear_qkv.weight", "attn.qkv.bias": "self_attention.linear_qkv.bias",
          "attn.proj.weight": "self_attention.linear_proj.weight", "attn.proj.bias": "self_attention.linear_proj.bias",
          "mlp_norm.weight": "mlp.linear_fc1.layer_norm_weight", "mlp_norm.bias": "mlp.linear_fc1.layer_norm_bias",
          "mlp.fc1.weight": "mlp.linear_fc1.weight", "mlp.fc1.bias": "mlp.linear_fc1.bias",
          "mlp.fc2.weight": "mlp.linear_fc2.weight", "mlp.fc2.bias": "mlp.linear_fc2.bias"}
# the local spec's own names for the fused norms, as some checkpoints hold them
_LOCAL = {"self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
          "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
          "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
          "mlp.linear_fc1.layer_norm_bias": "pre_mlp_layernorm.bias"}
_TOP = {"embedding.weight": "embedding.word_embeddings.weight", "pos_embedding.weight": "embedding.position_embeddings.weight",
        "final_norm.weight": "decoder.final_layernorm.weight", "final_norm.bias": "decoder.final_layernorm.bias",
        "output.weight": "output_layer.weight"}
_LINEARS = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")
# keys of models tessera does not compute: (key fragment, what it is)
_FOREIGN = ((".experts.", "mixture-of-experts layers (MoE)"), (".router.", "mixture-of-experts layers (MoE)"),
            ("linear_q_down_proj", "multi-latent attention (MLA)"), ("linear_kv_down_proj", "multi-latent attention (MLA)"),
            ("q_layernorm", "QK layer norms"), ("k_layernorm", "QK layer norms"))


class MegatronCheckpointError(ValueError):
    """A Megatron checkpoint tessera cannot read, or one of a model it does not compute."""


# -- the folder ---------------------------------------------------------------------------------
def iteration_folder(path: str) -> str:
    """The ``iter_NNNNNNN`` folder ``path`` names: itself, or the one its
    ``latest_checkpointed_iteration.txt`` names."""
    if os.path.isfile(os.path.join(path, COMMON)) or os.path.isfile(os.path.join(path, ".metadata")):
        return path
    latest = os.path.join(path, LATEST)
    if not os.path.isfile(latest):
        raise MegatronCheckpointError(f"{path} holds neither {LATEST} nor an iteration's {COMMON}: give a Megatron "
                                      "checkpoint folder (--save of Megatron-LM) or one of its iter_NNNNNNN folders")
    with open(latest) as f:
        text = f.read().strip()
    if text == "release":
        return os.path.join(path, "release")
    if not text.isdigit():
        raise MegatronCheckpointError(f"{latest} holds {text!r}, not an iteration number")
    return os.path.join(path, f"iter_{int(text):07d}")


def read_common(folder: str) -> dict:
    """``common.pt``: the iteration, Megatron-LM's ``args`` (an argparse.Namespace: a pickle,
    read only from a checkpoint the user trusts) and more."""
    file = os.path.join(folder, COMMON)
    if not os.path.isfile(file):
        raise MegatronCheckpointError(f"{file} is missing: not a Megatron-Core distributed checkpoint (torch_dist), "
                                      "or one copied in part")
    backend = "torch_dist"
    if os.path.isfile(os.path.join(folder, "metadata.json")):
        with open(os.path.join(folder, "metadata.json")) as f:
            backend = json.load(f).get("sharded_backend", backend)
    if backend != "torch_dist":
        raise MegatronCheckpointError(f"{folder} is in Megatron's {backend!r} format; tessera reads torch_dist "
                                      "(convert it with Megatron-LM's --ckpt-convert-format torch_dist)")
    try:
        common = torch.load(file, map_location="cpu", weights_only=False)
    except Exception as e:  # noqa: BLE001 -- whatever unpickling raises
        raise MegatronCheckpointError(f"{file} is unreadable ({type(e).__name__}: {e})") from None
    if not isinstance(common, dict) or not isinstance(common.get("args"), argparse.Namespace):
        raise MegatronCheckpointError(f"{file} holds no Megatron-LM args (the model's settings): save it with "
                                      "Megatron-LM's save_checkpoint, which writes them")
    return common


def read_tensors(folder: str) -> dict[str, Tensor]:
    """Every tensor of the checkpoint, whole, in this one process; a missing or short data file
    is named first."""
    from tessera.checkpoint.store import DamagedCheckpoint, check_files

    try:
        check_files(folder)
    except DamagedCheckpoint as e:
        raise MegatronCheckpointError(f"the Megatron checkpoint {folder} is damaged: {e}") from None
    saved = dcp.FileSystemReader(folder).read_metadata().state_dict_metadata
    state = {k: torch.empty(tuple(md.size), dtype=md.properties.dtype)  # (the optimizer's are not read)
             for k, md in saved.items() if isinstance(md, TensorStorageMetadata) and not k.startswith("optimizer.")}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, storage_reader=dcp.FileSystemReader(folder), no_dist=True)
    return state


# -- settings -----------------------------------------------------------------------------------
def model_settings(args: argparse.Namespace, shapes: dict[str, tuple]) -> dict:
    """The ``model`` section of tessera's config for Megatron-LM's ``args`` and the checkpoint's
    tensor shapes; a model tessera does not compute is refused in words."""
    a = vars(args)
    missing = [k for k in ("num_layers", "hidden_size", "num_attention_heads") if not a.get(k)]
    if missing:
        raise MegatronCheckpointError(f"common.pt's args lack {', '.join(missing)}: the model's settings are not "
                                      "all there (save it with Megatron-LM's save_checkpoint)")
    for fragment, what in _FOREIGN:
        if any(fragment in key for key in shapes):
            raise MegatronCheckpointError(f"the checkpoint holds {what} ({next(k for k in shapes if fragment in k)}): "
                                          "tessera does not compute them")
    if a.get("num_experts"):
        raise MegatronCheckpointError(f"num_experts = {a['num_experts']}: a mixture-of-experts model (MoE), which "
                                      "tessera does not compute")
    if a.get("multi_latent_attention"):
        raise MegatronCheckpointError("multi_latent_attention: MLA, which tessera does not compute")
    for flag, what in (("qk_layernorm", "QK layer norms"), ("apply_layernorm_1p", "zero-centred norm weights (1p)"),
                       ("squared_relu", "the squared ReLU"), ("add_qkv_bias", "QKV biases without other biases"),
                       ("rotary_interleaved", "interleaved RoPE"), ("use_rope_scaling", "RoPE scaling")):
        if a.get(flag) and not (flag == "add_qkv_bias" and a.get("add_bias_linear")):
            raise MegatronCheckpointError(f"{flag} is set: {what}, which tessera's model does not compute")
    norm = a.get("normalization", "LayerNorm")
    positions = a.get("position_embedding_type", "learned_absolute")
    bias = a.get("add_bias_linear", True)
    if norm == "LayerNorm" and positions == "learned_absolute" and not a.get("swiglu") and bias:
        family = "gpt2"
    elif norm == "RMSNorm" and positions == "rope" and a.get("swiglu") and not bias:
        family = "llama"
        if a.get("rotary_percent", 1.0) != 1.0:
            raise MegatronCheckpointError(f"rotary_percent = {a['rotary_percent']}: tessera rotates every channel")
    else:
        raise MegatronCheckpointError(
            f"normalization={norm}, position_embedding_type={positions}, swiglu={bool(a.get('swiglu'))}, "
            f"add_bias_linear={bias}: tessera computes GPT (LayerNorm, learned_absolute, GELU, biases) and Llama "
            "(RMSNorm, rope, swiglu, no biases) models only")
    hidden, heads = a["hidden_size"], a["num_attention_heads"]
    if a.get("kv_channels") not in (None, hidden // heads):
        raise MegatronCheckpointError(f"kv_channels = {a['kv_channels']} is not hidden_size / num_attention_heads: "
                                      "tessera's attention has hidden / heads channels per head")
    embedding = shapes.get(_TOP["embedding.weight"])
    if embedding is None:
        raise MegatronCheckpointError(f"the checkpoint has no {_TOP['embedding.weight']} (a pipeline stage's part only?)")
    vocab = embedding[0]
    if a.get("padded_vocab_size") not in (None, vocab):
        raise MegatronCheckpointError(f"args.padded_vocab_size = {a['padded_vocab_size']}, the embedding has {vocab} "
                                      "rows: the checkpoint does not match its own settings")
    output = shapes.get(_TOP["output.weight"])
    tied = not a.get("untie_embeddings_and_output_weights", False)
    if output is not None and output[0] != vocab:
        raise MegatronCheckpointError(f"output_layer.weight has {output[0]} rows, the embedding {vocab}: the "
                                      "vocabularies differ")
    settings = {"family": family, "vocab_size": vocab, "hidden": hidden, "layers": a["num_layers"], "heads": heads,
                "ffn_hidden": a.get("ffn_hidden_size") or 4 * hidden, "norm_eps": a.get("norm_epsilon", 1e-5),
                "tie_embeddings": tied}
    if family == "gpt2":
        settings["seq_len"] = shapes[_TOP["pos_embedding.weight"]][0]
        if not a.get("openai_gelu"):  # (Megatron's default GELU is the exact one)
            settings["gelu"] = "exact"
    else:
        groups = a.get("num_query_groups") if a.get("group_query_attention") else None
        settings |= {"kv_heads": groups or heads, "seq_len": a.get("seq_length") or 2048,
                     "rope_theta": float(a.get("rotary_base", 10000))}
    return settings


def check_vocabulary(vocab_size: int, tokenizer: str | None) -> None:
    """A tokenizer with more ids than the model's rows is not the one it was trained with."""
    if tokenizer:
        from tokenizers import Tokenizer

        ids = Tokenizer.from_file(tokenizer).get_vocab_size(with_added_tokens=True)
        if ids > vocab_size:
            raise MegatronCheckpointError(f"the tokenizer {tokenizer} has {ids} ids, the Megatron model's embedding "
                                          f"{vocab_size} rows: give the tokenizer its data was made with")


# -- tensors ------------------------------------------------------------------------------------
def _qkv_to_tessera(t: Tensor, m: ModelConfig) -> Tensor:
    """Megatron's [per group: q heads, k, v] rows -> tessera's [q; k; v] (weight or bias)."""
    groups, hd, rest = m.num_kv_heads, m.head_dim, t.shape[1:]
    q, k, v = t.reshape(groups, -1, *rest).split([m.heads // groups * hd, hd, hd], dim=1)
    return torch.cat([x.reshape(-1, *rest) for x in (q, k, v)])


def _qkv_to_megatron(t: Tensor, m: ModelConfig) -> Tensor:
    groups, hd, rest = m.num_kv_heads, m.head_dim, t.shape[1:]
    q, k, v = t.split([m.heads * hd, groups * hd, groups * hd])
    return torch.cat([x.reshape(groups, -1, *rest) for x in (q, k, v)], dim=1).reshape(-1, *rest)


def from_megatron(state: dict[str, Tensor], m: ModelConfig) -> dict[str, Tensor]:
    """Megatron's whole tensors (stacked layers) -> tessera's (names without ``model.``), fp32."""
    from tessera.checkpoint.hf import _whole_shapes

    out, used = {}, set()
    for name, shape in _whole_shapes(m).items():
        if name.startswith("layers."):
            _, i, part = name.split(".", 2)
            key = "decoder.layers." + _LAYER[part]
            if key not in state and "decoder.layers." + _LOCAL.get(_LAYER[part], "") in state:
                key = "decoder.layers." + _LOCAL[_LAYER[part]]
            if key in state and state[key].shape[0] != m.layers:
                raise MegatronCheckpointError(f"{key} stacks {state[key].shape[0]} layers, args.num_layers is {m.layers}")
            t = state[key][int(i)] if key in state else None
        else:
            key = _TOP[name]
            t = state.get(key)
            if t is None and name == "output.weight" and not m.tie_embeddings:
                raise MegatronCheckpointError("the checkpoint has no output_layer.weight, but its args untie it "
                                              "(untie_embeddings_and_output_weights)")
        if t is None:
            raise MegatronCheckpointError(f"the checkpoint lacks {key} (tessera's {name})")
        if _is_qkv(name):
            t = _qkv_to_tessera(t, m)
        if tuple(t.shape) != tuple(shape):
            raise MegatronCheckpointError(f"{key} is {list(t.shape)} per layer, the settings make it {list(shape)}")
        used.add(key)
        out[name] = t.float().contiguous()
    unused = sorted(set(state) - used - ({_TOP["output.weight"]} if m.tie_embeddings else set()))
    if unused:
        raise MegatronCheckpointError(f"the checkpoint holds {unused[:3]}{' ...' if len(unused) > 3 else ''}, which "
                                      "tessera's model has no place for (another architecture or setting)")
    return out


def _is_qkv(name: str) -> bool:
    return name.endswith(("attn.qkv.weight", "attn.qkv.bias"))


def to_megatron(whole: dict[str, Tensor], m: ModelConfig) -> dict[str, Tensor]:
    """tessera's whole tensors (names without ``model.``) -> Megatron's, layers stacked."""
    out: dict[str, Tensor] = {}
    layers: dict[str, list] = {}
    for name, t in whole.items():
        if name.startswith("layers."):
            _, i, part = name.split(".", 2)
            layers.setdefault(part, [None] * m.layers)[int(i)] = _qkv_to_megatron(t, m) if _is_qkv(name) else t
        else:
            out[_TOP[name]] = t
    for part, ts in layers.items():
        out["decoder.layers." + _LAYER[part]] = torch.stack(ts)
    if m.tie_embeddings:
        out.pop(_TOP["output.weight"], None)  # (Megatron saves a tied output layer with the embedding only)
    return out


def megatron_args(m: ModelConfig, **more) -> argparse.Namespace:
    """Megatron-LM's args for a tessera model (what its checkpoints carry in common.pt)."""
    gpt2 = m.family == "gpt2"
    return argparse.Namespace(
        num_layers=m.layers, hidden_size=m.hidden, num_attention_heads=m.heads, ffn_hidden_size=m.ffn_size,
        kv_channels=m.head_dim, group_query_attention=m.num_kv_heads != m.heads, num_query_groups=m.num_kv_heads,
        padded_vocab_size=m.vocab_size, seq_length=m.seq_len, max_position_embeddings=m.seq_len,
        normalization="LayerNorm" if gpt2 else "RMSNorm", norm_epsilon=m.norm_eps,
        position_embedding_type="learned_absolute" if gpt2 else "rope", rotary_base=int(m.rope_theta),
        rotary_percent=1.0, swiglu=not gpt2, openai_gelu=gpt2 and m.gelu == "tanh", add_bias_linear=gpt2, add_qkv_bias=False,
        untie_embeddings_and_output_weights=not m.tie_embeddings, num_experts=None, **more)


def write_megatron(root: str, iteration: int, state: dict[str, Tensor], common: dict) -> str:
    """A Megatron-Core torch_dist checkpoint ``root/iter_NNNNNNN`` (and root's
    ``latest_checkpointed_iteration.txt``): ``state``'s whole tensors, the local spec's (empty)
    extra states of each linear layer (replicated over TP, keyed by layer: the same at any TP /
    PP), ``common.pt`` and ``metadata.json``; returns the folder."""
    folder = os.path.join(root, f"iter_{iteration:07d}")
    os.makedirs(folder, exist_ok=True)
    layers = state["decoder.layers." + _LAYER["attn.qkv.weight"]].shape[0]
    objects = {}
    for linear in _LINEARS:
        for i in range(layers):  # (ShardedObject.unique_key: key/shard_<offset>_<shape>; DCP pickles the value)
            objects[f"decoder.layers.{linear}._extra_state/shard_{i}_{layers}"] = [None]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save({k: v.contiguous() for k, v in state.items()} | objects,
                 storage_writer=dcp.FileSystemWriter(folder), no_dist=True)
    torch.save(common, os.path.join(folder, COMMON))
    with open(os.path.join(folder, "metadata.json"), "w") as f:
        json.dump({"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
                   "common_backend_version": 1}, f)
    with open(os.path.join(root, LATEST), "w") as f:
        f.write(str(iteration))
    return folder


def run_settings(args: argparse.Namespace) -> dict:
    """The ``train``, ``optim`` and ``data`` sections of tessera's config for Megatron-LM's
    ``args``: the batches, seed, length, learning-rate schedule and data a resumed run must keep."""
    a = vars(args)
    train = {"global_batch": a.get("global_batch_size") or 16, "micro_batch": a.get("micro_batch_size") or 1,
             "seed": a.get("seed", 1234), "steps": a.get("train_iters") or 0}
    if a.get("rampup_batch_size"):
        train["batch_rampup"] = ",".join(str(int(x)) for x in a["rampup_batch_size"])
    optim = {}
    if a.get("lr") is not None:
        style = a.get("lr_decay_style") or "linear"  # (Megatron-LM's default)
        decay = a.get("lr_decay_iters") or a.get("train_iters") or 0
        warmup = a.get("lr_warmup_iters") or round((a.get("lr_warmup_fraction") or 0.0) * decay)
        optim = {"lr": a["lr"], "min_lr": a.get("min_lr", 0.0), "warmup": warmup,
                 "decay_style": "wsd" if style == "WSD" else style, "decay_steps": decay,
                 "weight_decay": a.get("weight_decay", 0.01), "beta1": a.get("adam_beta1", 0.9),
                 "beta2": a.get("adam_beta2", 0.999), "eps": a.get("adam_eps", 1e-8),
                 "clip_grad": a.get("clip_grad", 1.0)}
        if style == "WSD":
            optim["wsd_decay_steps"] = a.get("lr_wsd_decay_iters") or 0
    # the data Megatron trained on, so that resuming on it checks the seed and split (none: synthetic,
    # which claims no tokenizer)
    paths = [str(p) for p in a.get("data_path") or []]
    data = {"source": "indexed", "paths": paths, "split": a.get("split") or "969,30,1",
            "sample_order": "megatron"} if paths else {"source": "synthetic"}
    return {"train": train, "optim": optim, "data": data}


def run_args(train: dict, optim: dict, consumed_samples: int) -> dict:
    """Megatron-LM's args for a tessera run's ``train`` and ``optim`` sections (the inverse of
    :func:`run_settings`)."""
    style = optim.get("decay_style", "cosine")
    more = {"consumed_train_samples": consumed_samples, "global_batch_size": train.get("global_batch"),
            "micro_batch_size": train.get("micro_batch"), "seed": train.get("seed"), "train_iters": train.get("steps"),
            "lr": optim.get("lr"), "min_lr": optim.get("min_lr"), "lr_warmup_iters": optim.get("warmup"),
            "lr_decay_style": "WSD" if style == "wsd" else style,
            "lr_decay_iters": optim.get("decay_steps") or train.get("steps"),
            "lr_wsd_decay_iters": optim.get("wsd_decay_steps"), "weight_decay": optim.get("weight_decay"),
            "adam_beta1": optim.get("beta1"), "adam_beta2": optim.get("beta2"), "adam_eps": optim.get("eps"),
            "clip_grad": optim.get("clip_grad")}
    if train.get("batch_rampup"):
        more["rampup_batch_size"] = train["batch_rampup"].split(",")
    return more


def write_tessera(root: str, whole: dict[str, Tensor], model: dict, run: dict, iteration: int,
                  consumed_samples: int, files: dict[str, str] | None = None) -> str:
    """A tessera checkpoint ``root/step_<iteration>`` a run resumes from: the weights, Adam's
    moments at zero (Megatron's optimizer state is not read), the step and the consumed samples,
    so the data goes on at the next sample Megatron would have served."""
    import shutil

    from tessera.checkpoint import dcp as tessera_dcp
    from tessera.checkpoint import store
    from tessera.checkpoint.shards import Shard
    from tessera.config import Config, DataConfig, OptimConfig, TrainConfig, to_dict
    from tessera.optim import LRScheduler, MicroBatchCalculator

    train = TrainConfig(**{**run["train"], "steps": max(run["train"]["steps"], iteration, 1)})
    optim = OptimConfig(**run["optim"])
    config = Config(model=ModelConfig(**model), train=train, optim=optim, data=DataConfig(**run["data"]))
    partial = store.begin_save(root, iteration)
    shards = [Shard(prefix + name, tuple(t.shape), (0,) * t.ndim, t.float() if prefix == "model." else
                    torch.zeros_like(t, dtype=torch.float32))
              for name, t in whole.items() for prefix in ("model.", "optim.exp_avg.", "optim.exp_avg_sq.")]
    tessera_dcp.write(partial, shards, {})
    for name, source in (files or {}).items():
        shutil.copyfile(source, os.path.join(partial, name))
    batches = MicroBatchCalculator.from_config(train, 1).state_dict()
    return store.finish_save(partial, {
        "contents": "megatron", "step": iteration, "adam_step": 0.0,
        "batches": batches | {"consumed_samples": consumed_samples},
        "scheduler": LRScheduler(optim, train.steps).state_dict(), "scaler": None, "numerics": None,
        "layout": {"tp": 1, "cp": 1, "pp": 1, "dp": 1, "vpp": 1, "zero": 0, "dtype": "fp32"},
        "config": to_dict(config)}, keep=0)


__all__ = ["run_settings", "run_args", "write_tessera", "MegatronCheckpointError", "iteration_folder", "read_common", "read_tensors", "model_settings",
           "check_vocabulary", "from_megatron", "to_megatron", "megatron_args", "write_megatron"]
