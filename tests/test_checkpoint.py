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
import time

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


@pytest.mark.timeout(60)
def test_a_background_save_writes_the_state_of_its_step(tmp_path, monkeypatch):
    """checkpoint.async_save: the weights change (training goes on) while the thread writes; the
    checkpoint holds the values of the step it was taken at. A failed background save raises at
    the next wait."""
    stage, optimizer, checkpointer, scheduler, data = _stack(["checkpoint.async_save=true"], tmp_path / "ck")
    release, real_write = __import__("threading").Event(), dcp.write

    def slow_write(*args):
        assert release.wait(30)
        real_write(*args)
    monkeypatch.setattr(dcp, "write", slow_write)
    before = {n: p.detach().clone() for n, p in stage.chunks[0].named_parameters()}
    checkpointer.save(1, scheduler, data, None)
    with torch.no_grad():
        for p in stage.chunks[0].parameters():
            p.add_(1.0)  # "the next steps"
    release.set()
    assert checkpointer.wait() == str(tmp_path / "ck" / "step_00000001")
    saved = dcp.read_whole(str(tmp_path / "ck" / "step_00000001"))
    assert torch.equal(saved["model.layers.0.mlp.fc1.weight"], before["layers.0.mlp.fc1.weight"])
    assert torch.equal(saved["model.embedding.weight"], before["embedding.weight"][:100])

    def dies(path, meta):
        raise OSError("disk full")
    monkeypatch.setattr(store, "write_meta", dies)
    checkpointer.save(2, scheduler, data, None)
    with pytest.raises(RuntimeError, match="background checkpoint save failed: disk full"):
        checkpointer.wait()
    assert [s for s, _ in checkpoints(str(tmp_path / "ck"))] == [1]


@pytest.mark.timeout(120)
def test_a_finetune_takes_the_weights_only_and_a_restart_goes_on_from_its_own_checkpoints(tmp_path):
    _train_here(tmp_path, "pre", ["train.steps=3", f"checkpoint.dir={tmp_path}/pre"])
    source = f"{tmp_path}/pre/step_00000003"
    # the weights, nothing else: saved again at once, the parameters are the source's, Adam's
    # moments zero, the data at its start
    _, _, checkpointer, scheduler, data = _stack(["checkpoint.finetune=true", f"checkpoint.load={source}"],
                                                 tmp_path / "again")
    assert checkpointer.load(source, scheduler, data, None, weights_only=True) == (0, False)
    checkpointer.save(0, scheduler, data, None)
    again, pre = dcp.read_whole(f"{tmp_path}/again/step_00000000", ""), dcp.read_whole(source, "")
    assert all(torch.equal(again[k], pre[k]) for k in pre if k.startswith("model."))
    assert all(not again[k].any() for k in pre if k.startswith("optim.")) and any(pre[k].any() for k in pre if k.startswith("optim."))
    meta = json.loads(open(f"{tmp_path}/again/step_00000000/tessera.json").read())
    assert meta["batches"]["consumed_samples"] == 0 and meta["adam_step"] == 0
    # a fine-tune run with its own batch size and schedule, then the same command for longer:
    # it goes on from its own newest checkpoint, not from checkpoint.load again
    tune = ["checkpoint.finetune=true", f"checkpoint.load={source}", f"checkpoint.dir={tmp_path}/ft",
            "checkpoint.save_every=1", "train.global_batch=24", "optim.lr=3e-3", "optim.decay_steps=4"]
    first = _train_here(tmp_path, "ft1", tune + ["train.steps=2"])
    assert [m["step"] for m in first] == [1, 2]
    assert json.loads(open(f"{tmp_path}/ft/step_00000001/tessera.json").read())["batches"]["consumed_samples"] == 24
    straight = _train_here(tmp_path, "ft_straight", tune[:2] + ["train.global_batch=24", "optim.lr=3e-3",
                                                               "optim.decay_steps=4", "train.steps=4"])
    assert curve(first) == curve(straight)[:2]
    later = _train_here(tmp_path, "ft2", tune + ["train.steps=4"])
    assert curve(later) == curve(straight)[2:]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_one_run_at_a_time_saves_into_a_checkpoint_dir(tmp_path, capsys):
    """Two runs saving into one checkpoint.dir would replace each other's checkpoints: while one
    holds it (rank 0's lock), another is refused, by the launcher before torchrun too. The same
    folder may be both out_dir and checkpoint.dir."""
    from tessera.training.metrics import CHECKPOINT_LOCK_NAME, lock_out_dir

    held = lock_out_dir(tmp_path / "ck", "checkpoint.dir", CHECKPOINT_LOCK_NAME)  # a run saving there now
    try:
        with pytest.raises(ConfigError, match="checkpoint.dir: .* is in use by another run"):
            _train_here(tmp_path, "out", ["train.steps=1", f"checkpoint.dir={tmp_path}/ck"])
        capsys.readouterr()  # (the launcher's refusal, in this process: before torchrun would start)
        assert main(["train", "--nproc-per-node", "2", "--set", f"checkpoint.dir={tmp_path}/ck", "--set",
                     f"train.out_dir={tmp_path}/out2"]) == 2
        err = capsys.readouterr().err
        assert "checkpoint.dir" in err and "in use by another run" in err, err
    finally:
        held.close()
    _train_here(tmp_path, "both", ["train.steps=1", f"checkpoint.dir={tmp_path}/both"])  # out_dir == checkpoint.dir
    assert [s for s, _ in checkpoints(f"{tmp_path}/both")] == [1]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_slow_save_is_not_cut_short_by_the_step_watchdog(tmp_path, monkeypatch, mode):
    """train.timeout_s=2 and saves of 400 s (a large model's on a slow shared file system; in the
    background, the next save's wait for it): the watchdog's timer is off while the run saves or
    waits for a save, the save's time is not counted into the next step's limit, and the run
    finishes with its checkpoints. On a clock of the test's own, with a stand-in for the timer
    that records when it would have gone off (steps take 0.1 s)."""
    import threading

    from tessera.checkpoint import Checkpointer
    from tessera.training import trainer
    from tessera.training.watchdog import StepWatchdog

    now, deadline, limits, fired = [0.0], [None], [], []
    training_waits = threading.Event()  # the training thread waits for a background save

    def arm(seconds):
        limits.append(seconds)
        deadline[0] = now[0] + seconds

    def elapse(seconds, what):
        now[0] += seconds
        if deadline[0] is not None and now[0] > deadline[0]:
            fired.append(what)

    real_write, real_wait, real_step = dcp.write, Checkpointer.wait, trainer.train_step

    def slow_write(*args):
        if threading.current_thread() is not threading.main_thread():
            assert training_waits.wait(60), "no one waited for the background save"
        elapse(400.0, f"a save ({mode})")
        real_write(*args)

    def wait(self):
        training_waits.set()
        try:
            return real_wait(self)
        finally:
            training_waits.clear()

    def step(*args, **kwargs):
        result = real_step(*args, **kwargs)
        elapse(0.1, "a step")
        return result
    monkeypatch.setattr(trainer, "StepWatchdog", lambda timeout_s: StepWatchdog(
        timeout_s, arm=arm, disarm=lambda: deadline.__setitem__(0, None), clock=lambda: now[0]))
    monkeypatch.setattr(trainer, "train_step", step)
    monkeypatch.setattr(dcp, "write", slow_write)
    monkeypatch.setattr(Checkpointer, "wait", wait)
    history = _train_here(tmp_path, "out", ["train.steps=4", "checkpoint.save_every=2", "train.timeout_s=2",
                                            f"checkpoint.dir={tmp_path}/ck", f"checkpoint.async_save={mode == 'async'}"])
    assert [m["step"] for m in history] == [1, 2, 3, 4] and now[0] > 800
    assert fired == [], f"the step timer would have ended the run during {fired}"
    assert limits and set(limits) == {2.0}, limits  # (a save counted into a step would raise its limit)
    assert [s for s, _ in checkpoints(f"{tmp_path}/ck")] == [2, 4]


@pytest.mark.timeout(120)
def test_a_background_save_outlives_a_failing_step(tmp_path, monkeypatch):
    """checkpoint.async_save: step 4 fails while step 3's checkpoint is being written; the run
    finishes that write before it stops, so a restart goes on from step 3."""
    import threading

    from tessera.training import trainer

    real_write, real_step, calls, failed = dcp.write, trainer.train_step, [], threading.Event()

    def slow_write(*args):
        assert failed.wait(60), "step 4 never failed"
        time.sleep(1.0)  # still writing while the error goes up
        real_write(*args)

    def failing_step(*args, **kwargs):
        calls.append(1)
        if len(calls) == 4:
            failed.set()
            raise RuntimeError("step 4 failed")
        return real_step(*args, **kwargs)
    monkeypatch.setattr(dcp, "write", slow_write)
    monkeypatch.setattr(trainer, "train_step", failing_step)
    with pytest.raises(RuntimeError, match="step 4 failed"):
        _train_here(tmp_path, "out", ["train.steps=6", "checkpoint.save_every=3", "checkpoint.async_save=true",
                                      f"checkpoint.dir={tmp_path}/ck"])
    assert [s for s, _ in checkpoints(f"{tmp_path}/ck")] == [3]


@pytest.mark.timeout(120)
def test_new_schedule_resumes_everything_but_the_schedule(tmp_path):
    """checkpoint.new_schedule: a halved optim.lr from the resumed step on; the weights, the data's
    position and Adam's moments are the checkpoint's (step 5's loss and gradient norm are the
    straight run's; its moments too, which do not depend on the learning rate)."""
    from tessera.optim import LRScheduler

    run = ["train.steps=6", "checkpoint.save_every=1", "optim.decay_steps=6"]
    straight = _train_here(tmp_path, "straight", run + [f"checkpoint.dir={tmp_path}/a"])
    step4 = f"checkpoint.load={tmp_path}/a/step_00000004"
    assert _refusal([step4, "train.steps=6", "optim.lr=5e-3"])[1].endswith(
        "or set checkpoint.new_schedule=true to resume with this run's schedule")
    changed = _train_here(tmp_path, "changed", run + [step4, f"checkpoint.dir={tmp_path}/b", "optim.lr=5e-3",
                                                      "checkpoint.new_schedule=true"])
    cfg = load_config(None, BASE + run[::2] + ["optim.lr=5e-3"])
    assert [m["lr"] for m in changed] == pytest.approx([LRScheduler(cfg.optim, 6).lr(s) for s in (4, 5)])
    assert [m["lr"] for m in changed] != pytest.approx([m["lr"] for m in straight[4:]])
    assert (changed[0]["loss"], changed[0]["grad_norm"]) == (straight[4]["loss"], straight[4]["grad_norm"])
    assert changed[1]["loss"] != straight[5]["loss"]  # (the step-5 update was another)
    a, b = (dcp.read_whole(f"{tmp_path}/{d}/step_00000005", "") for d in "ab")
    moments = [k for k in a if "exp_avg" in k]
    assert moments and all(torch.equal(a[k], b[k]) for k in moments)
    assert not all(torch.equal(a[k], b[k]) for k in a if k.startswith("model."))
    with pytest.raises(ConfigError, match="checkpoint.new_schedule"):
        load_config(None, BASE + [step4, "checkpoint.finetune=true", "checkpoint.new_schedule=true"])


@pytest.mark.timeout(120)
def test_a_resume_on_other_data_says_so(tmp_path, capsys):
    """Another data.source (or data.paths) is allowed on a resume (a deliberate switch), and said."""
    run = ["train.steps=3", "model.vocab_size=256"]
    _train_here(tmp_path, "a", run + ["train.steps=2", f"checkpoint.dir={tmp_path}/ck"])
    capsys.readouterr()
    _train_here(tmp_path, "b", run + [f"checkpoint.load={tmp_path}/ck", "data.source=builtin"])
    assert "the data differs from the checkpoint's (data.source: 'synthetic' -> 'builtin')" in capsys.readouterr().out
