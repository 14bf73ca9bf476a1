"""Hugging Face ``transformers`` interchange: a checkpoint's weights as a GPT2LMHeadModel /
LlamaForCausalLM folder (``config.json`` + ``model.safetensors``), and such a folder as a
weights-only tessera checkpoint a run starts from with ``checkpoint.finetune=true``.

The mapping is names and layouts only: tessera's whole tensors are the single-process model's
(checkpoint/shards.py), which computes what transformers' models compute (tests/test_hf.py
compares their logits):

- GPT-2: ``attn.qkv`` is HF's ``c_attn`` ([q; k; v] rows), ``mlp.fc1`` / ``fc2`` its ``c_fc`` /
  ``c_proj``; HF's GPT-2 keeps its linear weights as Conv1D, [in, out]: transposed both ways.
- Llama: ``attn.qkv`` splits into ``q_proj``, ``k_proj``, ``v_proj`` (GQA: kv_heads * head_dim
  rows each for k and v), ``mlp.fc1`` into ``gate_proj`` and ``up_proj`` (gate first), RoPE as
  HF's rotate-half convention (both rotate the two halves of each head).
"""

from __future__ import annotations

import json
import os

import torch
from torch import Tensor

from tessera.config import ModelConfig

_GPT2_LAYER = {"attn_norm": "ln_1", "mlp_norm": "ln_2", "attn.qkv": "attn.c_attn", "attn.proj": "attn.c_proj",
               "mlp.fc1": "mlp.c_fc", "mlp.fc2": "mlp.c_proj"}
_LLAMA_LAYER = {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm", "attn.proj": "self_attn.o_proj",
                "mlp.fc2": "mlp.down_proj"}


def hf_config(m: ModelConfig) -> dict:
    """transformers' config.json for a tessera model."""
    if m.family == "gpt2":
        return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": m.vocab_size,
                "n_embd": m.hidden, "n_layer": m.layers, "n_head": m.heads, "n_inner": m.ffn_size,
                "n_positions": m.seq_len,
                "activation_function": "gelu_new" if m.gelu == "tanh" else "gelu", "layer_norm_epsilon": m.norm_eps,
                "resid_pdrop": m.dropout, "embd_pdrop": m.dropout, "attn_pdrop": m.dropout,
                "tie_word_embeddings": m.tie_embeddings, "bos_token_id": None, "eos_token_id": None,
                "initializer_range": m.init_std, "dtype": "float32"}
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": m.vocab_size,
            "hidden_size": m.hidden, "num_hidden_layers": m.layers, "num_attention_heads": m.heads,
            "num_key_value_heads": m.num_kv_heads, "head_dim": m.head_dim, "intermediate_size": m.ffn_size,
            "max_position_embeddings": m.seq_len, "rms_norm_eps": m.norm_eps, "rope_theta": m.rope_theta,
            "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "attention_dropout": m.dropout,
            "tie_word_embeddings": m.tie_embeddings, "bos_token_id": None, "eos_token_id": None,
            "initializer_range": m.init_std, "dtype": "float32"}


# settings whose other values compute another model than tessera's: refused, never dropped
_GPT2_FIXED = {"activation_function": ("gelu_new", "gelu_pytorch_tanh", "gelu"), "scale_attn_weights": (True,),
               "scale_attn_by_inverse_layer_idx": (False,), "add_cross_attention": (False,)}
_LLAMA_FIXED = {"hidden_act": ("silu",), "attention_bias": (False,), "mlp_bias": (False,)}


def _refuse_other(config: dict, fixed: dict) -> None:
    for key, allowed in fixed.items():
        if key in config and config[key] not in allowed:
            raise ValueError(f"{key} = {config[key]!r}: tessera's model computes {' or '.join(map(repr, allowed))} only")


def model_settings(config: dict) -> dict:
    """The ``model`` section of tessera's config for a transformers config.json; a setting
    tessera's model does not compute is refused."""
    kind = config.get("model_type")
    if kind == "gpt2":
        _refuse_other(config, _GPT2_FIXED)
        hidden = config["n_embd"]
        return {"family": "gpt2", "vocab_size": config["vocab_size"], "hidden": hidden, "layers": config["n_layer"],
                "heads": config["n_head"], "ffn_hidden": config.get("n_inner") or 4 * hidden,
                "seq_len": config["n_positions"], "norm_eps": config.get("layer_norm_epsilon", 1e-5),
                "tie_embeddings": config.get("tie_word_embeddings", True),
                **({"gelu": "exact"} if config.get("activation_function") == "gelu" else {})}
    if kind == "llama":
        _refuse_other(config, _LLAMA_FIXED)
        heads, hidden = config["num_attention_heads"], config["hidden_size"]
        if config.get("head_dim") not in (None, hidden // heads):
            raise ValueError(f"head_dim {config['head_dim']} is not hidden_size / num_attention_heads: tessera's "
                             "attention has hidden / heads channels per head")
        rope = config.get("rope_parameters") or {}
        scaling = config.get("rope_scaling") or {}
        kinds = {rope.get("rope_type"), scaling.get("rope_type"), scaling.get("type")} - {None, "default"}
        if kinds:  # (old config files name it "type", newer "rope_type"; rope_parameters since transformers 5)
            raise ValueError(f"RoPE scaling {sorted(kinds)[0]!r} ({scaling or rope}) is not built in tessera")
        return {"family": "llama", "vocab_size": config["vocab_size"], "hidden": hidden,
                "layers": config["num_hidden_layers"], "heads": heads,
                "kv_heads": config.get("num_key_value_heads") or heads, "ffn_hidden": config["intermediate_size"],
                "seq_len": config.get("max_position_embeddings") or 2048, "norm_eps": config.get("rms_norm_eps", 1e-6),
                "rope_theta": rope.get("rope_theta") or config.get("rope_theta") or 10000.0,
                "tie_embeddings": config.get("tie_word_embeddings", False)}
    raise ValueError(f"model_type {kind!r}: tessera reads gpt2 and llama models")


def to_hf(whole: dict[str, Tensor], m: ModelConfig) -> dict[str, Tensor]:
    """tessera's whole tensors (names without the ``model.`` prefix) -> transformers' state dict."""
    out: dict[str, Tensor] = {}
    gpt2 = m.family == "gpt2"
    root = "transformer" if gpt2 else "model"
    for name, t in whole.items():
        if name.startswith("layers."):
            _, i, rest = name.split(".", 2)
            part, leaf = rest.rsplit(".", 1)
            prefix = f"{root}.h.{i}." if gpt2 else f"{root}.layers.{i}."
            if gpt2:  # (Conv1D: [in, out])
                out[prefix + f"{_GPT2_LAYER[part]}.{leaf}"] = t.t().contiguous() if t.ndim == 2 else t
            elif part == "attn.qkv":
                q, kv = m.heads * m.head_dim, m.num_kv_heads * m.head_dim
                for proj, piece in zip(("q_proj", "k_proj", "v_proj"), t.split([q, kv, kv])):
                    out[prefix + f"self_attn.{proj}.{leaf}"] = piece.contiguous()
            elif part == "mlp.fc1":
                gate, up = t.chunk(2)
                out[prefix + f"mlp.gate_proj.{leaf}"], out[prefix + f"mlp.up_proj.{leaf}"] = gate.contiguous(), up.contiguous()
            else:
                out[prefix + f"{_LLAMA_LAYER[part]}.{leaf}"] = t
        elif name == "embedding.weight":
            out[f"{root}.wte.weight" if gpt2 else f"{root}.embed_tokens.weight"] = t
        elif name == "pos_embedding.weight":
            out[f"{root}.wpe.weight"] = t
        elif name.startswith("final_norm."):
            out[(f"{root}.ln_f." if gpt2 else f"{root}.norm.") + name.split(".")[-1]] = t
        elif name == "output.weight":
            out["lm_head.weight"] = t
        else:
            raise ValueError(f"no transformers name for {name}")
    return out


def from_hf(state: dict[str, Tensor], m: ModelConfig) -> dict[str, Tensor]:
    """transformers' state dict -> tessera's whole tensors (names without ``model.``), fp32: for
    each tensor, :func:`to_hf` on a meta tensor of its shape names the pieces, which are put back
    together in that order."""
    root = "transformer." if m.family == "gpt2" else "model."
    if not any(k.startswith(root) for k in state):  # saved from the base model (GPT2Model, LlamaModel)
        state = {(k if k.startswith("lm_head.") else root + k): v for k, v in state.items()}
    out, used = {}, set()
    for name, shape in _whole_shapes(m).items():
        pieces = to_hf({name: torch.empty(shape, device="meta")}, m)
        used.update(pieces)
        for key, want in pieces.items():
            if key not in state:
                raise ValueError(f"the transformers weights lack {key} (tessera's {name})")
            if tuple(state[key].shape) != tuple(want.shape):
                raise ValueError(f"the transformers weight {key} is {list(state[key].shape)}, the config makes it "
                                 f"{list(want.shape)}")
        t = torch.cat([state[key] for key in pieces]) if len(pieces) > 1 else state[next(iter(pieces))]
        if m.family == "gpt2" and name.startswith("layers.") and t.ndim == 2:
            t = t.t()
        out[name] = t.float().contiguous()
    # buffers transformers may have saved (GPT-2's causal masks, RoPE frequencies) carry no weights
    unused = [k for k in state if k not in used and not k.endswith((".attn.bias", ".attn.masked_bias", "inv_freq"))]
    if m.tie_embeddings:
        unused = [k for k in unused if k != "lm_head.weight"]  # (tied: a copy of the embedding)
    if unused:
        raise ValueError(f"the transformers weights hold {unused[:3]}{' ...' if len(unused) > 3 else ''}, which "
                         "tessera's model has no place for (another architecture, or settings it does not build)")
    return out


def _meta_model(m: ModelConfig):
    from tessera.models import GPTModel

    with torch.device("meta"):
        return GPTModel(m)


def _whole_shapes(m: ModelConfig) -> dict[str, tuple]:
    """One process's parameter shapes with the vocabulary's rows unpadded: a checkpoint's."""
    local = {n: tuple(p.shape) for n, p in _meta_model(m).named_parameters()}
    return {n: (m.vocab_size, *s[1:]) if n in ("embedding.weight", "output.weight") else s for n, s in local.items()}


def _read_json(path: str) -> dict:
    """A transformers JSON file as a dict; refused in one line naming the file where it is not one."""
    try:
        with open(path) as f:
            value = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not JSON ({e.msg} at line {e.lineno}, column {e.colno}): give the folder "
                         "transformers' save_pretrained wrote, or repair the file") from None
    except UnicodeDecodeError:
        raise ValueError(f"{path} is not text (JSON): give the folder transformers' save_pretrained wrote") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path} holds a JSON {type(value).__name__}, not an object of settings: give the folder "
                         "transformers' save_pretrained wrote, or repair the file")
    return value


def read_hf_folder(folder: str) -> tuple[dict, dict[str, Tensor]]:
    """(config.json, every tensor) of a transformers model folder (one safetensors file, or an
    index of several)."""
    from safetensors.torch import load_file

    config = _read_json(os.path.join(folder, "config.json"))
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index} has no weight_map (tensor name -> file): write the model again with "
                             "transformers' save_pretrained, or remove the index if model.safetensors holds it all")
        files = sorted(set(weight_map.values()))
    elif os.path.isfile(os.path.join(folder, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        raise ValueError(f"{folder} holds no model.safetensors (nor its index): save it with safe_serialization")
    model_settings(config)  # (a model tessera does not build is refused before its weights are read)
    state: dict[str, Tensor] = {}
    for name in files:
        try:
            state.update(load_file(os.path.join(folder, name)))
        except Exception as e:  # noqa: BLE001 -- safetensors' own error type
            raise ValueError(f"{os.path.join(folder, name)} is not a readable safetensors file ({e})") from None
    return config, state


def write_hf_folder(folder: str, config: dict, state: dict[str, Tensor]) -> None:
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(folder, "model.safetensors"),
              metadata={"format": "pt"})
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f, indent=1)


def end_of_document(tokenizer_json: str, eod_id: int) -> int | None:
    """The end-of-document id a model trained with this tokenizer stops at: the run's
    data.eod_id where it set one, else the tokenizer's own end-of-document token (the one
    `tessera preprocess` appends), else None."""
    if eod_id >= 0:
        return eod_id
    from tokenizers import Tokenizer

    from tessera.data.preprocess import PreprocessError, find_eod

    try:
        return find_eod(Tokenizer.from_file(tokenizer_json))
    except PreprocessError:
        return None


def stop_ids(folder: str, config: dict, vocab_size: int) -> list[int]:
    """A transformers model's end-of-sequence ids (config.json's ``eos_token_id``, else its
    generation_config.json's; one id or several), those inside the vocabulary."""
    ids = config.get("eos_token_id")
    generation = os.path.join(folder, "generation_config.json")
    if ids is None and os.path.isfile(generation):
        with open(generation) as f:
            ids = json.load(f).get("eos_token_id")
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    return [i for i in ids if isinstance(i, int) and 0 <= i < vocab_size]


def write_hf_tokenizer(folder: str, tokenizer_json: str, eod: int | None, seq_len: int) -> None:
    """``tokenizer.json`` and a ``tokenizer_config.json`` that transformers' AutoTokenizer reads
    (a fast tokenizer: the same ids as the tokenizers library's)."""
    import shutil

    from tokenizers import Tokenizer

    target = os.path.join(folder, "tokenizer.json")
    if os.path.abspath(tokenizer_json) != os.path.abspath(target):
        shutil.copyfile(tokenizer_json, target)
    settings = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": seq_len}
    if eod is not None:
        token = Tokenizer.from_file(tokenizer_json).id_to_token(eod)
        settings |= {"eos_token": token, "bos_token": token}
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump(settings, f, indent=1)


__all__ = ["hf_config", "model_settings", "to_hf", "from_hf", "read_hf_folder", "write_hf_folder", "end_of_document",
           "stop_ids", "write_hf_tokenizer"]
