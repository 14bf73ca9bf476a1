"""Distributed checkpoints (tessera/checkpoint): a resumed run continues bit for bit on its own
layout; a checkpoint loads into any other layout as the same whole tensors (resharding is a
copy); those whole tensors are the single-process model's; a save is visible only once complete;
bad resumes are refused up front, in words.

Multi-rank runs call the trainer's ``train`` (or its pieces) inside ``run_ranks`` workers (gloo).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tessera.checkpoint import checkpoints, dcp, store
from tessera.checkpoint.shards import flat_boxes
from tessera.cli import main
from tessera.config import ConfigError, load_config
from tessera.testing import run_ranks
from training_runs import train_histories

BASE = ["model.hidden=32", "model.layers=2", "model.heads=4", "model.seq_len=16", "model.vocab_size=100",
        "train.micro_batch=1", "train.global_batch=12", "train.seed=3", "train.log_every=1",
        "data.source=synthetic", "optim.lr=1e-2", "optim.warmup=2", "optim.decay_style=cosine",
        "optim.decay_steps=5", "optim.min_lr=1e-3", "optim.clip_grad=0.5", "parallel.bucket_size=700"]
LLAMA = ["model.family=llama", "model.kv_heads=2", "model.tie_embeddings=false"]


def histories(world, runs, timeout=240):
    """Each run's metrics (``BASE + overrides``, the trainer on ``world`` ranks)."""
    return train_histories(world, BASE, runs, timeout)


def curve(history, keys=("loss", "grad_norm", "lr")):
    return [(m["step"], *(m.get(k) for k in keys)) for m in history]


def numbers(history):
    """Losses and gradient norms, flat (for pytest.approx)."""
    return [m[k] for m in history for k in ("loss", "grad_norm")]


# -- boxes ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(7,), (5, 6), (1, 9), (4, 1)])
def test_flat_boxes_cover_each_range_once(shape):
    whole = torch.arange(torch.Size(shape).numel()).reshape(shape)
    n = whole.numel()
    for a in range(n + 1):
        for b in range(a, n + 1):
            seen = torch.zeros(shape, dtype=torch.long)
            boxes = flat_boxes(shape, a, whole.reshape(-1)[a:b])
            assert len(boxes) <= 3
            for offsets, view in boxes:
                index = tuple(slice(o, o + s) for o, s in zip(offsets, view.shape))
                assert torch.equal(whole[index], view)  # the view holds the numbers at its offsets
                seen[index] += 1
            assert seen.reshape(-1)[a:b].eq(1).all() and seen.sum() == b - a


# -- resume on the same layout: bit for bit ------------------------------------------------------
LAYOUTS = {
    "tp2-sp-dp2-zero1-bf16-llama": (4, ["parallel.tp=2", "parallel.dp=2", "parallel.zero=1",
                                        "parallel.sequence_parallel=true", "train.dtype=bf16", *LLAMA]),
    "pp2-dp2-zero3-tied-async": (4, ["parallel.pp=2", "parallel.dp=2", "parallel.zero=3", "checkpoint.async_save=true"]),
    "pp2-vpp2-fp16-dropout": (2, ["parallel.pp=2", "parallel.vpp=2", "model.layers=4", "train.dtype=fp16",
                                  "model.dropout=0.2", "model.tie_embeddings=false"]),
    "dp2-zero2-bf16-rampup": (2, ["parallel.dp=2", "parallel.zero=2", "train.dtype=bf16",
                                  "train.batch_rampup=2,2,8"]),
}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", [n if n == "dp2-zero2-bf16-rampup" else pytest.param(n, marks=pytest.mark.slow)
                                  for n in LAYOUTS])  # (one 2-rank layout in the fast subset)
def test_a_resumed_run_continues_bit_for_bit(tmp_path, name):
    world, layout = LAYOUTS[name]
    straight, resumed = histories(world, [
        layout + ["train.steps=5", "checkpoint.save_every=2", f"checkpoint.dir={tmp_path}/a",
                  f"train.out_dir={tmp_path}/out_a"],
        layout + ["train.steps=5", f"checkpoint.load={tmp_path}/a/step_00000002",
                  f"checkpoint.dir={tmp_path}/b", f"train.out_dir={tmp_path}/out_b"],
    ])
    assert [s for s, _ in checkpoints(f"{tmp_path}/a")] == [2, 4, 5]
    assert [s for s, _ in checkpoints(f"{tmp_path}/b")] == [5]
    keys = ("loss", "grad_norm", "lr", "weight_decay", "tokens", "loss_scale", "skipped")
    assert curve(resumed, keys) == curve(straight, keys)[2:]
    a, b = dcp.read_whole(f"{tmp_path}/a/step_00000005", ""), dcp.read_whole(f"{tmp_path}/b/step_00000005", "")
    assert a.keys() == b.keys() and any(k.startswith("optim.exp_avg_sq.") for k in a)
    for key in a:
        assert torch.equal(a[key], b[key]), key
    meta_a, meta_b = (json.loads(open(f"{tmp_path}/{run}/step_00000005/tessera.json").read()) for run in "ab")
    for key in ("step", "adam_step", "batches", "scheduler", "scaler", "layout"):
        assert meta_b[key] == meta_a[key], key  # (the scaler's clean steps count on from the save's)
    assert meta_b["adam_step"] == 5 and meta_b["batches"]["consumed_samples"] == sum(m["tokens"] for m in straight) // 16
    assert (meta_b["scaler"] is not None) == ("fp16" in name)


# -- another layout: the same whole tensors ------------------------------------------------------
def _stack(overrides, dst):
    """The trainer's pieces for one rank, untrained, with a Checkpointer saving into ``dst``."""
    from tessera.checkpoint import Checkpointer
    from tessera.optim import LRScheduler
    from tessera.topology import Topology
    from tessera.training.build import build
    from tessera.training.data_feed import DataFeed
    from tessera.training.preflight import validate

    cfg = load_config(None, BASE + overrides + [f"checkpoint.dir={dst}", "train.steps=5"])
    p = cfg.parallel
    topo = Topology.build(tp=p.tp, pp=p.pp, dp=p.dp)
    cfg = validate(cfg, topo.world_size)  # (parallel.dp resolved, as the trainer's preflight does)
    parts = build(cfg, topo)
    checkpointer = Checkpointer(cfg, topo, parts.chunks, parts.data_parallel, parts.optimizer, parts.rng,
                                log=lambda line: None)
    return parts, parts.optimizer, checkpointer, LRScheduler(cfg.optim, cfg.train.steps), DataFeed(cfg, topo)


def _reshard_worker(rank, world, overrides, src, dst):
    """Load ``src`` into the layout of ``overrides`` and save it again, untrained, into ``dst``."""
    _, _, checkpointer, scheduler, data = _stack(overrides, dst)
    step, _ = checkpointer.load(src, scheduler, data, None)
    checkpointer.save(step, scheduler, data, None)
    return step


RESHARD = [
    (1, []),
    (2, ["parallel.dp=2", "parallel.zero=1", "train.dtype=bf16"]),  # flat shards, 16-bit model
    (3, ["parallel.dp=3", "parallel.zero=2"]),  # shards ending mid-row
    (3, ["parallel.dp=3", "parallel.zero=3"]),  # FSDP's uneven rows (100 / 3)
    (4, ["parallel.tp=4"]),  # vocabulary rows on 2 of 4 ranks, padding on the others (gpt2: 4 kv heads)
    (2, ["parallel.pp=2"]),  # a tied embedding's copy on the last stage
]


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_a_checkpoint_loads_into_any_layout_as_the_same_whole_tensors(tmp_path, family):
    model = LLAMA if family == "llama" else []
    source = ["parallel.tp=2", "parallel.pp=2", *model]
    straight = histories(4, [source + ["train.steps=5", "checkpoint.save_every=3", f"checkpoint.dir={tmp_path}/tp2pp2",
                                       f"train.out_dir={tmp_path}/o1"]])[0]
    # the unsharded model trained alike: the whole tensors are its tensors (layout parity)
    single = histories(1, [model + ["train.steps=3", f"checkpoint.dir={tmp_path}/single",
                                    f"train.out_dir={tmp_path}/o2"]])[0]
    assert numbers(single) == pytest.approx(numbers(straight[:3]), rel=1e-5)
    src = f"{tmp_path}/tp2pp2/step_00000003"
    saved = dcp.read_whole(src, "")
    whole = dcp.read_whole(f"{tmp_path}/single/step_00000003", "")
    assert saved.keys() == whole.keys()
    for key in saved:  # (Adam turns rounding differences in tiny gradients into updates of up to
        a, b = saved[key], whole[key]  # lr: up to ~1e-4 of a tensor's largest entry or norm here)
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3 * float(b.abs().max()), msg=key)
        assert (a - b).norm() <= 1e-3 * b.norm(), key
    assert saved["model.embedding.weight"].shape == (100, 32)
    for i, (world, layout) in enumerate(RESHARD):
        if family == "llama" and "parallel.tp=4" in layout:
            continue  # (its 2 kv heads do not split 4 ways)
        assert run_ranks(_reshard_worker, world, model + layout, src, f"{tmp_path}/re{i}", timeout=120) == [3] * world
        again = dcp.read_whole(f"{tmp_path}/re{i}/step_00000003", "")
        assert again.keys() == saved.keys(), layout
        for key in saved:
            assert torch.equal(again[key], saved[key]), (layout, key)
    # and trains on from it on one process as the tp=2 x pp=2 run did
    resumed = histories(1, [model + ["train.steps=5", f"checkpoint.load={src}", f"train.out_dir={tmp_path}/o3"]])[0]
    assert numbers(resumed) == pytest.approx(numbers(straight[3:]), rel=1e-5)


# -- on disk: complete or absent; refusals ----------------------------------------------------------
def _train_here(tmp_path, name, overrides):
    from tessera.training.trainer import train

    return train(load_config(None, BASE + overrides + [f"train.out_dir={tmp_path}/{name}"]))


@pytest.mark.timeout(120)
def test_a_save_that_dies_leaves_the_older_checkpoints_and_a_restart_resumes(tmp_path, monkeypatch, capsys):
    straight = _train_here(tmp_path, "straight", ["train.steps=3"])
    run = ["train.steps=3", "checkpoint.save_every=1", f"checkpoint.dir={tmp_path}/ck"]

    def dies(path, meta):  # every rank has written its boxes; the save dies before it is complete
        raise OSError("disk full")
    monkeypatch.setattr(store, "write_meta", dies)
    with pytest.raises(OSError, match="disk full"):
        _train_here(tmp_path, "dies", run)
    assert checkpoints(f"{tmp_path}/ck") == [] and [p for p in os.listdir(f"{tmp_path}/ck") if p.startswith("step")] == \
        ["step_00000001.partial"]
    monkeypatch.undo()
    first = _train_here(tmp_path, "first", ["train.steps=2", "checkpoint.save_every=1", f"checkpoint.dir={tmp_path}/ck"])
    assert [s for s, _ in checkpoints(f"{tmp_path}/ck")] == [1, 2] and curve(first) == curve(straight)[:2]
    # the same command again, for all 3 steps: it resumes from step 2 by itself
    again = _train_here(tmp_path, "again", run)
    assert curve(again) == curve(straight)[2:]
    assert sorted(p for p in os.listdir(f"{tmp_path}/ck") if p.startswith("step")) == \
        ["step_00000001", "step_00000002", "step_00000003"]
    # once more: the newest checkpoint is at train.steps, so nothing trains (and it says so)
    capsys.readouterr()
    assert _train_here(tmp_path, "nothing", run) == [] and "nothing to train" in capsys.readouterr().out
    # checkpoint.keep: the newest ones stay
    _train_here(tmp_path, "keep", ["train.steps=5", "checkpoint.save_every=1", "checkpoint.keep=2",
                                   f"checkpoint.dir={tmp_path}/ck"])
    assert [s for s, _ in checkpoints(f"{tmp_path}/ck")] == [4, 5]


def _refusal(overrides):
    from tessera.training.preflight import check_runnable

    with pytest.raises(ConfigError) as err:
        check_runnable(load_config(None, BASE + overrides), 1)
    return err.value.key, str(err.value)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_resumes_that_cannot_work_are_refused_before_the_run(tmp_path, capsys):
    _train_here(tmp_path, "out", ["train.steps=4", "checkpoint.save_every=2", f"checkpoint.dir={tmp_path}/ck"])
    step2 = f"checkpoint.load={tmp_path}/ck/step_00000002"
    BUILTIN = ["data.source=builtin", "model.vocab_size=256"]  # (a split that splits: the demo corpus)
    _train_here(tmp_path, "bi", BUILTIN + ["train.steps=2", f"checkpoint.dir={tmp_path}/bi"])
    import shutil
    shutil.copytree(tmp_path / "bi" / "step_00000002", tmp_path / "old" / "step_00000002")
    meta = store.read_meta(str(tmp_path / "old" / "step_00000002"))
    del meta["config"]["data"]["sample_order"]
    store.write_meta(str(tmp_path / "old" / "step_00000002"), meta)
    os.makedirs(tmp_path / "empty")
    os.makedirs(tmp_path / "hf")
    (tmp_path / "hf" / "config.json").write_text("{}")
    cases = [
        ([f"checkpoint.load={tmp_path}/nowhere"], "checkpoint.load", "does not exist"),
        ([f"checkpoint.load={tmp_path}/empty"], "checkpoint.load", "neither a checkpoint nor a folder"),
        ([f"checkpoint.load={tmp_path}/hf"], "checkpoint.load", f"`tessera checkpoint import {tmp_path}/hf --out DIR`"),
        ([step2, "model.hidden=64"], "model.hidden", "saved with hidden = 32, this run's model has 64"),
        ([step2, "model.family=llama", "model.tie_embeddings=false"], "model.family", "saved with family = gpt2"),
        ([step2, "model.seq_len=32"], "model.seq_len", "16 learned positions"),
        ([step2, "model.norm_eps=1e-6"], "model.norm_eps", "saved with norm_eps = 1e-05"),
        ([step2, "train.steps=1"], "train.steps", "at step 2"),
        ([step2, "train.global_batch=16"], "train.batch_rampup", "use the checkpoint's train.global_batch"),
        ([step2, "optim.lr=0.5"], "optim.lr", "set it back to 0.01"),
        ([step2, "train.seed=4"], "train.seed", "trained with train.seed=3, this run has 4: the data would be reshuffled"),
        ([f"checkpoint.load={tmp_path}/bi/step_00000002", *BUILTIN, "data.split=90,10,0"], "data.split",
         "set data.split=969,30,1 to resume"),
        ([f"checkpoint.load={tmp_path}/bi/step_00000002", *BUILTIN, "data.sample_order=epochs"], "data.sample_order",
         "set data.sample_order=megatron to resume"),
        # saved before data.sample_order existed: trained in the per-epoch order
        ([f"checkpoint.load={tmp_path}/old/step_00000002", *BUILTIN], "data.sample_order",
         "trained with data.sample_order=epochs"),
        ([step2, f"checkpoint.dir={tmp_path}/ck"], "checkpoint.load", "older checkpoint of checkpoint.dir"),
        ([step2, "train.steps=1"], "train.steps", "checkpoint.finetune=true to start a new run"),
        (["checkpoint.finetune=true"], "checkpoint.finetune", "checkpoint.load is not"),
        ([f"checkpoint.dir={tmp_path}/ck", "train.steps=3"], "train.steps", "it is checkpoint.dir's own newest"),
    ]
    # damaged copies: a data file missing, one cut short, tessera.json unreadable
    for name, damage, words in [
        ("missing", lambda p: os.remove(p / "__0_0.distcp"), "__0_0.distcp is missing"),
        ("short", lambda p: os.truncate(p / "__0_0.distcp", 100), "__0_0.distcp holds 100 bytes, its index says"),
        ("json", lambda p: (p / "tessera.json").write_text("{"), "its tessera.json is unreadable"),
    ]:
        shutil.copytree(tmp_path / "ck" / "step_00000002", tmp_path / name / "step_00000002")
        damage(tmp_path / name / "step_00000002")
        cases.append(([f"checkpoint.load={tmp_path}/{name}"], "checkpoint.load", f"is damaged: {words}"))
        capsys.readouterr()
        assert main(["checkpoint", "inspect", f"{tmp_path}/{name}"]) == 1
        shown = capsys.readouterr()
        assert f"damaged: {words}" in shown.out, shown.out + shown.err
    for overrides, key, words in cases:
        got_key, message = _refusal(overrides + ["train.steps=4"] if not any("train.steps" in o for o in overrides)
                                    else overrides)
        assert got_key == key and words in message, (overrides, message)
    (tmp_path / "file").write_text("")
    assert _refusal([f"checkpoint.dir={tmp_path}/file"])[0] == "checkpoint.dir"
    from tessera.training.preflight import check_runnable
    # the same split said another way is the same split (synthetic data: no split at all)
    check_runnable(load_config(None, BASE + [f"checkpoint.load={tmp_path}/bi/step_00000002", *BUILTIN,
                                             "train.steps=4", "data.split=1938,60,2"]), 1)
    check_runnable(load_config(None, BASE + [step2, "train.steps=4", "data.split=90,10,0"]), 1)
    check_runnable(load_config(None, BASE + [f"checkpoint.load={tmp_path}/old/step_00000002", *BUILTIN,
                                             "train.steps=4", "data.sample_order=epochs"]), 1)
    # another layout, dtype, dropout or data are no refusal: loading reshards
    check_runnable(load_config(None, BASE + [step2, "train.steps=6", "train.dtype=bf16", "model.dropout=0.1",
                                             "parallel.tp=2", "parallel.zero=1"]), 2)
    # a fine-tune takes the weights only: other steps, batches and schedule are its own
    check_runnable(load_config(None, BASE + [step2, "checkpoint.finetune=true", "train.steps=1", "optim.lr=0.5",
                                             "train.global_batch=24"]), 1)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_tessera_train_resumes_through_the_launcher(tmp_path, capsys):
    """Two processes under torchrun (the README's command), the second run from the first's step 2."""
    def launch(name, extra):
        sets = [a for item in BASE + ["parallel.dp=2", "parallel.zero=1", "train.steps=4",
                                      f"train.out_dir={tmp_path}/{name}"] + extra for a in ("--set", item)]
        proc = subprocess.run([sys.executable, "-m", "tessera", "train", "--nproc-per-node", "2", *sets],
                              capture_output=True, text=True, timeout=240)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        return [json.loads(line) for line in lines], proc.stdout

    straight, out = launch("a", ["checkpoint.save_every=2", f"checkpoint.dir={tmp_path}/ck", "checkpoint.async_save=true"])
    assert f"tessera: saved {tmp_path}/ck/step_00000002" in out
    resumed, out = launch("b", [f"checkpoint.load={tmp_path}/ck/step_00000002"])
    assert f"resumed from {tmp_path}/ck/step_00000002 at step 2" in out, out
    assert curve(resumed) == curve(straight)[2:]
    # what a checkpoint holds, without loading it
    capsys.readouterr()
    assert main(["checkpoint", "inspect", f"{tmp_path}/ck", "--tensors"]) == 0
    shown = capsys.readouterr()
    from tessera.models import GPTModel
    with torch.device("meta"):
        params = sum(p.numel() for p in GPTModel(load_config(None, BASE).model).parameters())
    params -= (128 - 100) * 32  # the vocabulary's padding rows (to 64 * tp) are not in a checkpoint
    assert "step_00000002: step 2, saved" in shown.out and "at tp=1 cp=1 pp=1 dp=2 vpp=1 zero=1 dtype=fp32" in shown.out
    assert f"{params:,} parameters" in shown.out and "24 samples consumed" in shown.out
    assert "model.layers.1.attn.qkv.weight [96, 32]" in shown.out and "step_00000004: step 4" in shown.out
    assert main(["checkpoint", "inspect", f"{tmp_path}/nowhere"]) == 2
    assert "neither a checkpoint" in capsys.readouterr().err
