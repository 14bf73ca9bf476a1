"""Checkpoints while a run goes on: a background save writes its step's state and outlives a
failing step, a slow save is not cut short by the step watchdog, a finetune takes the weights
only, one run at a time saves into a directory, a new schedule or other data on resume."""

from __future__ import annotations

import json
import time

import pytest
import torch

from tessera.checkpoint import checkpoints, dcp, store
from tessera.cli import main
from tessera.config import ConfigError, load_config
from test_checkpoint import BASE, _refusal, _stack, _train_here, curve


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
