"""Megatron-Core distributed checkpoints in and out, with megatron-core as the real client.

megatron-core builds a small GPTModel (local layer spec, fp32; GPT with either GELU and Llama with
GQA, untied) on one gloo process, at tp=2 or at pp=2 on two, and saves it with its own
``dist_checkpointing.save`` the way Megatron-LM's ``save_checkpoint`` does (``iter_NNNNNNN/`` with
the model's sharded state, the iteration and the args in common.pt). ``tessera checkpoint import --megatron`` converts it; tessera's logits equal
megatron-core's forward and a run resumed from it takes its first step on the samples Megatron
would have served next, at megatron-core's loss on them. ``tessera checkpoint export --megatron``
writes one megatron-core's ``dist_checkpointing.load`` reads into a fresh GPTModel (tp=1 or 2),
whose logits then equal tessera's. The refusals need no megatron-core.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import subprocess
import sys
import tempfile

import pytest
import torch

from tessera.checkpoint import dcp, megatron, store
from tessera.config import ModelConfig, load_config
from tessera.models import GPTModel
from parity import tessera_model

HIDDEN, HEADS, LAYERS, VOCAB, SEQ = 64, 4, 2, 128, 16
FAMILIES = {
    "gpt2": dict(normalization="LayerNorm", position_embedding_type="learned_absolute", swiglu=False,
                 openai_gelu=True, add_bias_linear=True, group_query_attention=False, num_query_groups=None,
                 untie_embeddings_and_output_weights=False, ffn_hidden_size=4 * HIDDEN, norm_epsilon=1e-5),
    "llama": dict(normalization="RMSNorm", position_embedding_type="rope", swiglu=True, openai_gelu=False,
                  add_bias_linear=False, group_query_attention=True, num_query_groups=2,
                  untie_embeddings_and_output_weights=True, ffn_hidden_size=96, norm_epsilon=1e-6, rotary_base=500000),
}


def megatron_args(family: str, **more) -> argparse.Namespace:
    """Megatron-LM's args of a run (the part its checkpoints' common.pt carries that matters here)."""
    return argparse.Namespace(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, kv_channels=None,
                              padded_vocab_size=VOCAB, seq_length=SEQ, max_position_embeddings=SEQ, rotary_percent=1.0,
                              global_batch_size=4, micro_batch_size=2, seed=1234, train_iters=20, lr=1e-4,
                              min_lr=1e-5, lr_warmup_iters=2, lr_decay_style="cosine", lr_decay_iters=None,
                              weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8, clip_grad=1.0,
                              consumed_train_samples=28, **(FAMILIES[family] | more))


@pytest.fixture(scope="module")
def mcore():
    """megatron-core on one gloo process (model parallel sizes 1). Its torch_dist save calls
    ``torch.cuda.synchronize`` and ``torch.cuda.current_device`` unconditionally (0.16.1): on CPU
    those two become a no-op and the CPU for this module's tests. Its RNG tracker is the
    inference one, which forks without CUDA."""
    pytest.importorskip("megatron.core", reason="megatron-core is not installed here (pip install -e '.[test]')")
    pytest.importorskip("psutil", reason="megatron-core's checkpoint writer needs psutil (the test extra)")
    import torch.distributed as dist
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.tensor_parallel.random import initialize_rng_tracker

    with pytest.MonkeyPatch.context() as patch:
        if not torch.cuda.is_available():
            patch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
            patch.setattr(torch.cuda, "current_device", lambda: "cpu")
        dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
        parallel_state.initialize_model_parallel(1, 1)
        # (megatron-core's inference tracker: forks without CUDA streams; the models here draw no dropout)
        initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
        try:
            yield dist_checkpointing
        finally:
            initialize_rng_tracker(force_reset=True)
            parallel_state.destroy_model_parallel()
            dist.destroy_process_group()


def megatron_model(args: argparse.Namespace, seed: int, tp: int = 1, pp: int = 1, pre_process: bool = True,
                   post_process: bool = True):
    """megatron-core's GPTModel (local spec) for ``args``, every parameter random (norms and
    biases too: a mapping that mixes them up shows)."""
    from megatron.core.models.gpt import GPTModel as MegatronGPT
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    a = vars(args)
    gelu = (lambda x: torch.nn.functional.gelu(x, approximate="tanh")) if a["openai_gelu"] else torch.nn.functional.gelu
    config = TransformerConfig(
        num_layers=a["num_layers"], hidden_size=a["hidden_size"], num_attention_heads=a["num_attention_heads"],
        num_query_groups=a["num_query_groups"], ffn_hidden_size=a["ffn_hidden_size"], normalization=a["normalization"],
        layernorm_epsilon=a["norm_epsilon"], gated_linear_unit=a["swiglu"], add_bias_linear=a["add_bias_linear"],
        activation_func=torch.nn.functional.silu if a["swiglu"] else gelu, hidden_dropout=0.0, attention_dropout=0.0,
        use_cpu_initialization=True, params_dtype=torch.float32, tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32)
    torch.manual_seed(seed)
    model = MegatronGPT(config, get_gpt_layer_local_spec(normalization=a["normalization"]),
                        vocab_size=a["padded_vocab_size"], max_sequence_length=a["max_position_embeddings"],
                        position_embedding_type=a["position_embedding_type"], rotary_base=a.get("rotary_base", 10000),
                        share_embeddings_and_output_weights=not a["untie_embeddings_and_output_weights"],
                        pre_process=pre_process, post_process=post_process)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.1).add_(1.0 if p.ndim == 1 and p.shape[0] == HIDDEN else 0.0)
    return model.eval()


def megatron_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    s = tokens.shape[1]
    position_ids = torch.arange(s).expand_as(tokens)
    causal = torch.ones(s, s, dtype=torch.bool).triu(1)[None, None]  # (True: masked; its default mask is on CUDA)
    with torch.no_grad():
        return model(tokens, position_ids, attention_mask=causal)


def save_megatron(dist_checkpointing, model, args, root, iteration: int) -> None:
    """As Megatron-LM's save_checkpoint: iter_NNNNNNN/ and latest_checkpointed_iteration.txt."""
    import torch.distributed as dist

    folder = os.path.join(root, f"iter_{iteration:07d}")
    os.makedirs(folder, exist_ok=True)
    dist_checkpointing.save({"model": model.sharded_state_dict(), "iteration": iteration, "args": args,
                             "checkpoint_version": 3.0}, folder)
    if dist.get_rank() == 0:
        with open(os.path.join(root, megatron.LATEST), "w") as f:
            f.write(str(iteration))


def cli(*args) -> subprocess.CompletedProcess:
    """``tessera checkpoint ...`` in this process: its exit status and what it printed."""
    from tessera.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["checkpoint", *args])
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("family, more", [("gpt2", {}), ("gpt2", {"openai_gelu": False}), ("llama", {})],
                         ids=["gpt2", "gpt2-exact-gelu", "llama"])
def test_a_megatron_checkpoint_imports_resumes_and_exports_back(mcore, tmp_path, family, more):
    from tessera.training.data_feed import build_source
    from tessera.training.trainer import train

    args = megatron_args(family, **more)
    theirs = megatron_model(args, seed=1)
    save_megatron(mcore, theirs, args, tmp_path / "meg", iteration=7)
    done = cli("import", "--megatron", f"{tmp_path}/meg", "--out", f"{tmp_path}/ck")
    assert done.returncode == 0, done.stderr
    assert "optimizer state not imported: Adam moments start at zero" in done.stdout
    path = f"{tmp_path}/ck/step_00000007"
    meta = store.read_meta(path)
    assert (meta["step"], meta["batches"]["consumed_samples"]) == (7, 28)
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
    ours = tessera_model(path)
    torch.testing.assert_close(ours.full_logits(tokens), megatron_logits(theirs, tokens), rtol=0, atol=1e-5)

    # a run resumed with the printed settings goes on at step 8 with samples 28..31, Megatron's next
    flags = done.stdout.split("resume from it with: ")[1].split(" --set train.steps")[0].split()
    base = [flags[i + 1] for i in range(0, len(flags), 2)] + [
        "train.steps=8", "data.source=synthetic", f"train.out_dir={tmp_path}/out", f"checkpoint.dir={tmp_path}/run",
        "train.log_every=1", "train.eval_every=0"]
    history = train(load_config(None, base))
    assert [h["step"] for h in history] == [8]
    source = build_source(load_config(None, base))
    rows = torch.stack([torch.from_numpy(source[i].astype("int64")) for i in range(28, 32)])
    with torch.no_grad():
        logits = megatron_logits(theirs, rows[:, :-1])
        want = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), rows[:, 1:].reshape(-1))
    assert history[0]["loss"] == pytest.approx(want.item(), abs=1e-5)

    # export: megatron-core loads it into a fresh GPTModel, whose logits are tessera's
    done = cli("export", path, "--megatron", f"{tmp_path}/back")
    assert done.returncode == 0, done.stderr
    fresh = megatron_model(args, seed=2)
    folder = megatron.iteration_folder(f"{tmp_path}/back")
    assert folder.endswith("iter_0000007")
    loaded = mcore.load({"model": fresh.sharded_state_dict()}, folder)
    fresh.load_state_dict(loaded["model"])
    assert loaded["iteration"] == 7 and loaded["args"].consumed_train_samples == 28
    torch.testing.assert_close(megatron_logits(fresh, tokens), ours.full_logits(tokens), rtol=0, atol=1e-5)


def _at_tp2(rank, world_size, family, folder, tokens, save: bool):
    """One of two ranks of megatron-core at tp=2: saves its model to ``folder`` (``save``), or
    loads it from there; rank 0 returns the whole logits (gathered over the vocabulary's halves)."""
    import multiprocessing

    import torch.distributed as dist
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.tensor_parallel.random import initialize_rng_tracker

    torch.cuda.synchronize, torch.cuda.current_device = (lambda *a, **k: None), (lambda: "cpu")  # (see mcore)
    # megatron-core's writer starts a helper process, which a daemonic run_ranks worker may not
    multiprocessing.current_process()._config["daemon"] = False
    parallel_state.initialize_model_parallel(2, 1)
    initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    args = megatron_args(family)
    model = megatron_model(args, seed=1 if save else 2, tp=2)  # (the same draws on both ranks: replicated norms agree)
    if save:
        save_megatron(dist_checkpointing, model, args, folder, 5)
    else:
        model.load_state_dict(dist_checkpointing.load({"model": model.sharded_state_dict()}, folder)["model"])
    local = megatron_logits(model, tokens).contiguous()
    halves = [torch.empty_like(local) for _ in range(world_size)]
    dist.all_gather(halves, local)
    parallel_state.destroy_model_parallel()
    return torch.cat(halves, dim=-1) if rank == 0 else None


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_megatron_at_tp2_saves_what_tessera_imports_and_loads_what_it_exports(tmp_path, family):
    pytest.importorskip("megatron.core", reason="megatron-core is not installed here (pip install -e '.[test]')")
    pytest.importorskip("psutil", reason="megatron-core's checkpoint writer needs psutil (the test extra)")
    from tessera.testing import run_ranks

    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
    want = run_ranks(_at_tp2, 2, family, str(tmp_path / "meg"), tokens, True, timeout=240)[0]
    done = cli("import", "--megatron", f"{tmp_path}/meg", "--out", f"{tmp_path}/ck")
    assert done.returncode == 0, done.stderr
    ours = tessera_model(f"{tmp_path}/ck/step_00000005")
    torch.testing.assert_close(ours.full_logits(tokens), want, rtol=0, atol=1e-5)
    done = cli("export", f"{tmp_path}/ck", "--megatron", f"{tmp_path}/back")
    assert done.returncode == 0, done.stderr
    back = run_ranks(_at_tp2, 2, family, f"{tmp_path}/back/iter_0000005", tokens, False, timeout=240)[0]
    torch.testing.assert_close(back, ours.full_logits(tokens), rtol=0, atol=1e-5)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_resumed_run_serves_the_samples_megatron_would_have_served_next(mcore, tmp_path):
    """On an indexed corpus in megatron-core's own GPTDataset order (the same train_iters x
    global_batch samples, seed and split): the first step after the import is on megatron-core's
    samples consumed .. consumed + global_batch, at its model's loss on them."""
    import types

    import numpy as np
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    from tessera.data import IndexedDatasetWriter
    from tessera.training.trainer import train

    rng = np.random.default_rng(0)
    prefix = str(tmp_path / "corpus")
    with IndexedDatasetWriter(prefix, np.uint16) as writer:
        for _ in range(300):
            writer.add_document(np.append(rng.integers(2, VOCAB, int(rng.integers(1, 60))), 1))
    args = megatron_args("llama", data_path=[prefix], split="98,2,0")
    tokenizer = types.SimpleNamespace(vocab_size=VOCAB, eod=1, unique_identifiers={"class": "test"})
    config = GPTDatasetConfig(random_seed=args.seed, sequence_length=SEQ, blend=([prefix], None), split="98,2,0",
                              tokenizer=tokenizer, reset_position_ids=False, reset_attention_mask=False,
                              eod_mask_loss=False, create_attention_mask=False)
    served = BlendedMegatronDatasetBuilder(GPTDataset, [args.train_iters * args.global_batch_size, 8, 8],
                                           lambda: True, config).build()[0]
    theirs = megatron_model(args, seed=1)
    save_megatron(mcore, theirs, args, tmp_path / "meg", iteration=7)
    done = cli("import", "--megatron", f"{tmp_path}/meg", "--out", f"{tmp_path}/ck")
    assert done.returncode == 0, done.stderr
    words = done.stdout.split("resume from it with: ")[1].splitlines()[0].split()  # (its data flags too)
    sets = [words[i + 1] for i, w in enumerate(words) if w == "--set" and not words[i + 1].startswith("train.steps")]
    assert f"data.paths={prefix}" in sets and "data.split=98,2,0" in sets
    history = train(load_config(None, sets + [
        f"train.steps={args.train_iters}", f"data.cache_dir={tmp_path}/cache", f"train.out_dir={tmp_path}/out",
        f"checkpoint.dir={tmp_path}/run", "train.log_every=1"]))
    assert history[0]["step"] == 8
    first = range(args.consumed_train_samples, args.consumed_train_samples + args.global_batch_size)
    tokens = torch.stack([served[i]["tokens"] for i in first]).long()
    labels = torch.stack([served[i]["labels"] for i in first]).long()
    want = torch.nn.functional.cross_entropy(megatron_logits(theirs, tokens).reshape(-1, VOCAB), labels.reshape(-1))
    assert history[0]["loss"] == pytest.approx(want.item(), abs=1e-5)


def _stage_at_pp2(rank, world_size, family, full_state, root):
    """One of two pipeline stages of megatron-core at pp=2 (one layer each), holding its part of
    the one-process model ``full_state``, saved together as Megatron-LM saves."""
    import multiprocessing

    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.tensor_parallel.random import initialize_rng_tracker

    torch.cuda.synchronize, torch.cuda.current_device = (lambda *a, **k: None), (lambda: "cpu")  # (see mcore)
    multiprocessing.current_process()._config["daemon"] = False  # (see _at_tp2)
    parallel_state.initialize_model_parallel(1, 2)
    initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    args = megatron_args(family, untie_embeddings_and_output_weights=True)
    stage = megatron_model(args, seed=1, pp=2, pre_process=rank == 0, post_process=rank == 1)
    local = {}
    for key in stage.state_dict():  # (a stage numbers its layers from 0; the one-process model globally)
        parts = key.split(".")
        if key.startswith("decoder.layers."):
            parts[2] = str(int(parts[2]) + rank)
        local[key] = full_state[".".join(parts)]
    stage.load_state_dict(local)
    save_megatron(dist_checkpointing, stage, args, root, 9)
    parallel_state.destroy_model_parallel()


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_checkpoint_megatron_saved_at_pp2_imports_whole(mcore, tmp_path, family):
    from tessera.testing import run_ranks

    args = megatron_args(family, untie_embeddings_and_output_weights=True)
    theirs = megatron_model(args, seed=1)
    run_ranks(_stage_at_pp2, 2, family, theirs.state_dict(), str(tmp_path / "meg"), timeout=240)
    done = cli("import", "--megatron", f"{tmp_path}/meg", "--out", f"{tmp_path}/ck")
    assert done.returncode == 0, done.stderr
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
    ours = tessera_model(f"{tmp_path}/ck/step_00000009")
    torch.testing.assert_close(ours.full_logits(tokens), megatron_logits(theirs, tokens), rtol=0, atol=1e-5)


# -- refusals and layouts, on checkpoints tessera writes (no megatron-core needed) ------------------
def run(capsys, *args) -> subprocess.CompletedProcess:
    """``tessera checkpoint ...`` in this process (the refusals: fast), as :func:`cli` reports it."""
    from tessera.cli import main

    code = main(["checkpoint", *args])
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, out, err)


def tessera_megatron(root, family: str = "llama", iteration: int = 3, rename=None, **args) -> ModelConfig:
    """A Megatron checkpoint of a random tessera model, written by tessera's exporter; ``rename``
    maps Megatron keys to others, ``args`` override its args."""
    a = megatron_args(family)
    m = ModelConfig(family=family, vocab_size=VOCAB, hidden=HIDDEN, layers=LAYERS, heads=HEADS,
                    kv_heads=a.num_query_groups or 0, ffn_hidden=a.ffn_hidden_size, seq_len=SEQ,
                    tie_embeddings=family == "gpt2", norm_eps=a.norm_epsilon, rope_theta=float(getattr(a, "rotary_base", 1e4)))
    model = GPTModel(m)
    model.init_weights(3)
    whole = {n: p.detach()[: VOCAB] if n in ("embedding.weight", "output.weight") else p.detach()
             for n, p in model.named_parameters()}
    state = megatron.to_megatron(whole, m)
    state = {(rename or {}).get(k, k): v for k, v in state.items()}
    common = {"iteration": iteration, "args": megatron.megatron_args(m, consumed_train_samples=12) }
    vars(common["args"]).update(args)
    megatron.write_megatron(str(root), iteration, state, common)
    return m


def test_qkv_regrouping_is_megatrons_per_group_layout():
    m = ModelConfig(family="llama", hidden=32, heads=4, kv_heads=2, vocab_size=64, seq_len=8)
    hd = m.head_dim  # rows: tessera [q0 q1 q2 q3 | k0 k1 | v0 v1]; Megatron [q0 q1 k0 v0 | q2 q3 k1 v1]
    rows = torch.arange(8 * hd).float()
    got = megatron._qkv_to_megatron(rows, m).view(8, hd)[:, 0] // hd
    assert got.tolist() == [0, 1, 4, 6, 2, 3, 5, 7]
    assert torch.equal(megatron._qkv_to_tessera(megatron._qkv_to_megatron(rows, m), m), rows)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_local_and_fused_norm_names_import_alike(capsys, tmp_path, family):
    local = {f"decoder.layers.{fused}": f"decoder.layers.{name}" for fused, name in megatron._LOCAL.items()}
    tessera_megatron(tmp_path / "fused", family)
    tessera_megatron(tmp_path / "local", family, rename=local)
    for name in ("fused", "local"):
        done = run(capsys, "import", "--megatron", f"{tmp_path}/{name}", "--out", f"{tmp_path}/ck_{name}")
        assert done.returncode == 0, done.stderr
    a, b = (dcp.read_whole(f"{tmp_path}/ck_{n}/step_00000003") for n in ("fused", "local"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    meta = store.read_meta(f"{tmp_path}/ck_fused/step_00000003")
    assert (meta["step"], meta["batches"]["consumed_samples"], meta["adam_step"]) == (3, 12, 0.0)


REFUSALS = {
    "moe": (dict(num_experts=8), "mixture-of-experts"),
    "mla": (dict(multi_latent_attention=True), "MLA"),
    "squared_relu": (dict(squared_relu=True), "squared ReLU"),
    "norm": (dict(normalization="RMSNorm"), "normalization=RMSNorm, position_embedding_type=learned_absolute"),
    "qk_norm": (dict(qk_layernorm=True), "QK layer norms"),
    "vocab": (dict(padded_vocab_size=VOCAB + 64), f"padded_vocab_size = {VOCAB + 64}, the embedding has {VOCAB}"),
    "no_settings": (dict(hidden_size=None), "common.pt's args lack hidden_size"),
    "layers": (dict(num_layers=3), "decoder.layers.self_attention.linear_qkv.layer_norm_weight stacks 2 layers, "
               "args.num_layers is 3"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_import_refuses_a_model_tessera_does_not_compute(capsys, tmp_path, case):
    args, words = REFUSALS[case]
    tessera_megatron(tmp_path / "meg", "gpt2", **args)
    done = run(capsys, "import", "--megatron", f"{tmp_path}/meg", "--out", f"{tmp_path}/ck")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    import re
    assert re.search(words, done.stderr), done.stderr
    assert not os.path.exists(f"{tmp_path}/ck")


@pytest.mark.parametrize("key, words", [("mlp.experts.linear_fc1.weight", "mixture-of-experts layers (MoE)"),
                                        ("self_attention.linear_q_down_proj.weight", "multi-latent attention (MLA)")])
def test_import_refuses_moe_and_mla_weights_by_their_names(capsys, tmp_path, key, words):
    tessera_megatron(tmp_path / "meg", rename={"decoder.layers.mlp.linear_fc1.weight": "decoder.layers." + key})
    done = run(capsys, "import", "--megatron", f"{tmp_path}/meg", "--out", f"{tmp_path}/ck")
    assert done.returncode == 2 and f"{words} (decoder.layers.{key})" in done.stderr, done.stderr


def test_import_refuses_a_missing_or_cut_shard(capsys, tmp_path):
    tessera_megatron(tmp_path / "meg")
    folder = tmp_path / "meg" / "iter_0000003"
    data = sorted(p for p in os.listdir(folder) if p.endswith(".distcp"))
    with open(folder / data[0], "r+b") as f:
        f.truncate(100)
    done = run(capsys, "import", "--megatron", f"{tmp_path}/meg", "--out", f"{tmp_path}/ck")
    assert done.returncode == 2 and f"is damaged: {data[0]} holds 100 bytes" in done.stderr, done.stderr
    os.remove(folder / data[0])
    done = run(capsys, "import", "--megatron", str(folder), "--out", f"{tmp_path}/ck")
    assert done.returncode == 2 and f"is damaged: {data[0]} is missing" in done.stderr, done.stderr
    os.remove(folder / "common.pt")
    done = run(capsys, "import", "--megatron", str(folder), "--out", f"{tmp_path}/ck")
    assert done.returncode == 2 and "common.pt is missing" in done.stderr, done.stderr


def test_import_refuses_a_tokenizer_larger_than_the_vocabulary(capsys, tmp_path):
    from tokenizers import Tokenizer, models

    tessera_megatron(tmp_path / "meg")
    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB + 10)}, unk_token="w0"))
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    done = run(capsys, "import", "--megatron", f"{tmp_path}/meg", "--out", f"{tmp_path}/ck", "--tokenizer",
               str(tmp_path / "tokenizer.json"))
    assert done.returncode == 2 and f"has {VOCAB + 10} ids, the Megatron model's embedding {VOCAB} rows" in done.stderr


@pytest.mark.parametrize("family", list(FAMILIES))
def test_export_then_import_gives_the_same_checkpoint(capsys, tmp_path, family):
    tessera_megatron(tmp_path / "meg", family, **{k: v for k, v in vars(megatron_args(family)).items()
                                                 if k.startswith(("lr", "min_lr", "adam", "train_iters"))})
    assert run(capsys, "import", "--megatron", f"{tmp_path}/meg", "--out", f"{tmp_path}/one").returncode == 0
    done = run(capsys, "export", f"{tmp_path}/one", "--megatron", f"{tmp_path}/back")
    assert done.returncode == 0 and "--no-load-optim --no-load-rng" in done.stdout, done.stderr
    assert run(capsys, "import", "--megatron", f"{tmp_path}/back", "--out", f"{tmp_path}/two").returncode == 0
    one, two = (f"{tmp_path}/{n}/step_00000003" for n in ("one", "two"))
    a, b = dcp.read_whole(one, ""), dcp.read_whole(two, "")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    m1, m2 = store.read_meta(one), store.read_meta(two)
    for key in ("step", "batches", "scheduler"):
        assert m1[key] == m2[key], key
    assert m1["config"]["model"] == m2["config"]["model"] and m1["config"]["optim"] == m2["config"]["optim"]
