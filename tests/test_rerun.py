"""Non-finite steps (training/rerun.py): a bf16/fp32 step whose gradient norm is inf/nan changes
nothing (weights, Adam's moments, its step count); train.nonfinite=stop re-runs it and says
whether it came back (reproducible) or not (transient), then stops; skip passes it over and stops
after train.max_skipped_steps in a row. Faults are injected with train.inject_fault_step."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

from tessera.checkpoint import dcp
from tessera.config import ConfigError, ModelConfig, OptimConfig, load_config
from tessera.distributed.data_parallel import DataParallel
from tessera.models import GPTModel
from tessera.optim.optimizers import MainParamOptimizer
from tessera.testing import run_ranks
from tessera.topology import Topology
from tessera.training.rerun import NonFiniteStop

BASE = ["model.hidden=32", "model.layers=2", "model.heads=4", "model.seq_len=16", "model.vocab_size=100",
        "train.micro_batch=2", "train.global_batch=4", "train.seed=3", "train.log_every=1", "train.steps=5",
        "data.source=synthetic", "optim.lr=1e-2", "optim.clip_grad=1.0"]


def _train(overrides):
    from tessera.training.trainer import train

    return train(load_config(None, BASE + overrides))


def _stop(overrides) -> str:
    with pytest.raises(NonFiniteStop) as e:
        _train(overrides)
    return str(e.value)


def _optimizer_and_backward(dtype: torch.dtype):
    """A one-layer model in its data-parallel buffers (dp=1), its optimizer, and a function that
    runs one backward into the buffers."""
    model = GPTModel(ModelConfig(hidden=32, layers=1, heads=2, seq_len=8, vocab_size=50))
    model.init_weights(3)
    model.to(dtype)
    dp = DataParallel([model], Topology.build(), param_dtype=dtype)
    optimizer = MainParamOptimizer(dp, OptimConfig(lr=1e-2))
    tokens = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(0))

    def backward():
        dp.start_step(1)
        loss = model(tokens[:, :-1], tokens[:, 1:]).float().mean()
        loss.backward()
        dp.finish_grad_sync()

    return optimizer, backward


def _steps(path):
    return sorted(name for name in os.listdir(path) if name.startswith("step_"))


# -- the optimizers' skip ------------------------------------------------------------------------
@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_skipped_step_leaves_weights_moments_and_step_count(monkeypatch, fused, dtype):
    """The flag reaches AdamW: the fused kernel as found_inf (the CUDA path, run here by torch's
    fused CPU kernel), the foreach one through the host; an unset flag steps as before."""
    from tessera.optim import optimizers

    if fused:  # what CUDA runs: AdamW(fused=True), found_inf read on the device
        monkeypatch.setattr(optimizers, "_adamw", lambda groups, cfg, on_cuda, fused=False: torch.optim.AdamW(
            groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=True))
    optimizer, run_backward = _optimizer_and_backward(dtype)
    assert bool(optimizer.inner.defaults.get("fused")) == fused

    def snapshot():
        state = [(s["step"].item(), s["exp_avg"].clone(), s["exp_avg_sq"].clone()) for s in optimizer.inner.state.values()]
        return [m.clone() for m in optimizer.mains], state

    for skip in (False, False, True, True, False):
        run_backward()
        optimizer.grads()
        before = snapshot()
        optimizer.step(torch.tensor(0.5), skip=torch.tensor(skip))
        optimizer.zero_grad()
        after = snapshot()
        same = all(torch.equal(a, b) for a, b in zip(before[0], after[0]))
        if skip:
            assert same and before[1] and [s[0] for s in after[1]] == [s[0] for s in before[1]]
            assert all(torch.equal(a[1], b[1]) and torch.equal(a[2], b[2]) for a, b in zip(before[1], after[1]))
        else:
            assert not same
    assert {s["step"].item() for s in optimizer.inner.state.values()} == {3.0}


# -- the policies, one process -------------------------------------------------------------------
def test_stop_reproducible_fault_stops_before_saving_that_step(tmp_path):
    history_dir = tmp_path / "out"
    message = _stop([f"train.out_dir={history_dir}", "train.inject_fault_step=3",
                     f"checkpoint.dir={tmp_path}/ck", "checkpoint.save_every=1"])
    assert message.startswith("step 3: gradient norm nan")
    assert "samples 8..11 of the training stream" in message  # the third global batch of 4
    assert "again, so it is reproducible" in message and "resumes from the last one" in message
    assert _steps(tmp_path / "ck") == ["step_00000001", "step_00000002"]  # not step 3's, nor a later one
    lines = (history_dir / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 3 and '"skipped": true' in lines[2] and '"grad_norm": null' in lines[2]
    assert all(torch.isfinite(t).all() for t in dcp.read_whole(f"{tmp_path}/ck/step_00000002", "").values())


def test_stop_transient_fault_is_told_apart(tmp_path):
    message = _stop([f"train.out_dir={tmp_path}", "train.inject_fault_step=2", "train.inject_fault=nan_once",
                     "train.dtype=bf16"])
    assert message.startswith("step 2: gradient norm nan") and "samples 4..7" in message
    assert "so it is not reproducible: a transient fault" in message
    # the re-run saw the weights the step ran on (the step launched after it was skipped too)
    first, again = re.findall(r"loss ([-\w.+]+)", message)
    assert first == again, message
    assert "checkpoints" not in message  # none were saved (no checkpoint.dir)


def test_skip_passes_the_step_over_and_changes_nothing(tmp_path):
    history = _train([f"train.out_dir={tmp_path}/out", "train.inject_fault_step=3", "train.nonfinite=skip",
                      f"checkpoint.dir={tmp_path}/ck", "checkpoint.save_every=1"])
    assert [m["skipped"] for m in history] == [False, False, True, False, False]
    assert all(m["grad_norm"] == m["grad_norm"] for i, m in enumerate(history) if i != 2)
    two, three, four = (dcp.read_whole(f"{tmp_path}/ck/step_0000000{i}", "") for i in (2, 3, 4))
    assert two.keys() == three.keys() and any(k.startswith("optim") for k in two)
    assert all(torch.equal(two[k], three[k]) for k in two)  # weights and moments as step 2 left them
    assert not all(torch.equal(three[k], four[k]) for k in three)  # and training went on


def test_skip_stops_after_max_skipped_steps_in_a_row(tmp_path):
    """A diverged run (a learning rate of 1e12: the weights' scale overflows fp32) skips step
    after step; the fourth in a row stops it."""
    message = _stop([f"train.out_dir={tmp_path}", "train.nonfinite=skip", "train.max_skipped_steps=4",
                     "optim.lr=1e12", "optim.clip_grad=0", "train.steps=20"])
    assert "4 skipped steps in a row (train.max_skipped_steps=4): stopped" in message


def test_without_the_guard_a_nan_gradient_is_applied():
    """Why the guard exists: train_step without one lets a nan norm into every weight (the
    clipping factor is nan)."""
    optimizer, run_backward = _optimizer_and_backward(torch.float32)
    run_backward()
    grads = optimizer.grads()
    grads[0][0].view(-1)[0] = float("nan")
    norm = torch.stack([g.norm() for g, _ in grads]).norm()
    optimizer.step(torch.clamp(1.0 / (norm + 1e-6), max=1.0))
    assert all(torch.isnan(t).all() for t, *_ in optimizer.pieces)  # every parameter (not the buffer's padding)


def test_bad_settings_are_refused():
    for key, value in [("train.max_skipped_steps", "0"), ("train.inject_fault_step", "-1"),
                       ("train.nonfinite", "ignore")]:
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            load_config(None, BASE + [f"{key}={value}"])


@pytest.mark.slow
def test_the_command_says_it_once_and_exits_3(tmp_path, capsys):
    from tessera.cli import main

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in ["src", os.environ.get("PYTHONPATH", "")] if p)}
    sets = [a for o in BASE + [f"train.out_dir={tmp_path}", "train.inject_fault_step=2"] for a in ("--set", o)]
    capsys.readouterr()
    assert main(["train", *sets]) == 3  # (in this process: python -m tessera exits with main's status)
    err = capsys.readouterr().err
    assert err.count("step 2: gradient norm nan") == 1 and "Traceback" not in err, err
    # through the launcher too (torchrun's own status is 1): a job script can tell this stop from a crash
    done = subprocess.run([sys.executable, "-m", "tessera", "train", "--nproc-per-node", "2", *sets,
                           "--set", "parallel.dp=2", "--set", f"train.out_dir={tmp_path}/two"],
                          capture_output=True, text=True, env=env, timeout=180)
    assert done.returncode == 3, done.stderr[-3000:]
    assert "step 2: gradient norm nan" in done.stderr


# -- many ranks: every rank skips the same steps and reaches the same verdict ---------------------
def _ranks(rank, world, runs):
    out = []
    for overrides in runs:
        try:
            history = _train(overrides)
            out.append(("done", [m["skipped"] for m in history] if history else None))
        except NonFiniteStop as e:
            # (the loss is known on the last stage only: said there alone)
            out.append(("stop", re.sub(r"loss [-\w.+]+; | \(loss [-\w.+]+\)", "", str(e))))
    return out


@pytest.mark.slow
def test_every_rank_reaches_the_same_verdict(tmp_path):
    runs = [[f"train.out_dir={tmp_path}/a", "parallel.pp=2", "parallel.dp=2", "parallel.zero=1",
             "train.inject_fault_step=2", "train.inject_fault=nan_once"],
            [f"train.out_dir={tmp_path}/b", "parallel.pp=2", "parallel.dp=2", "parallel.zero=3",
             "train.inject_fault_step=2"],
            [f"train.out_dir={tmp_path}/c", "parallel.dp=2", "parallel.zero=3", "train.nonfinite=skip",
             "train.inject_fault_step=2", f"checkpoint.dir={tmp_path}/ck", "checkpoint.save_every=1"]]
    zero0 = [f"train.out_dir={tmp_path}/d", "parallel.dp=2", "train.inject_fault_step=2"]
    by_rank = run_ranks(_ranks, 4, runs[:2], timeout=300) + run_ranks(_ranks, 2, runs[2:] + [zero0], timeout=300)
    # zero=0: rank 0's nan comes after the dp all-reduce and the norm is not reduced over dp:
    # the loss's all-reduce tells rank 1, which stops too (it went on alone before, and hung)
    assert by_rank[4][1] == by_rank[5][1] and "again, so it is reproducible" in by_rank[4][1][1]
    transient, persistent = [r[0] for r in by_rank[:4]], [r[1] for r in by_rank[:4]]
    assert all(r == transient[0] for r in transient) and transient[0][0] == "stop"
    assert "not reproducible" in transient[0][1]
    assert all(r == persistent[0] for r in persistent) and "again, so it is reproducible" in persistent[0][1]
    fsdp = [r[0] for r in by_rank[4:6]]
    assert ("done", [False, True, False, False, False]) in fsdp
    one, two = (dcp.read_whole(f"{tmp_path}/ck/step_0000000{i}", "") for i in (1, 2))
    assert all(torch.equal(one[k], two[k]) for k in one)  # FSDP's shards and moments untouched


# -- gradient-norm spikes (train.skip_spikes) ----------------------------------------------------
def test_the_spike_window_flags_only_outliers_once_full_and_keeps_them_out():
    from tessera.training.rerun import SpikeWindow

    window = SpikeWindow(4, 3.0, torch.device("cpu"))
    flags = []
    for norm in [1.0, 50.0, 0.9, 1.1, 1.0, 1.05, 10.0, 1.2]:  # 50 comes before the window is full
        norm = torch.tensor(norm)
        spike = window.is_spike(norm)
        window.record(norm, ~spike)
        flags.append(bool(spike))
    assert flags == [False, False, False, False, False, False, True, False]
    assert int(window.count) == 7  # every step but the spike
    assert torch.equal(window.norms, torch.tensor([1.0, 1.05, 1.2, 1.1]))  # a ring of the last 4 applied
    again = SpikeWindow(4, 3.0, torch.device("cpu"))
    again.load_state_dict(window.state_dict())
    assert torch.equal(again.norms, window.norms) and int(again.count) == 7


SPIKES = ["train.skip_spikes=6", "train.spike_window=4", "train.inject_fault=spike", "train.inject_fault_step=6",
          "train.steps=8", "optim.decay_steps=8"]


def test_a_spike_is_passed_over_and_a_resumed_run_skips_it_too(tmp_path):
    """Step 6's gradient times 1e4: passed over (under the default nonfinite=stop too), nothing
    changed; a run resumed from step 4 has the window back and does the same, to the bit."""
    straight = _train([f"train.out_dir={tmp_path}/a", f"checkpoint.dir={tmp_path}/ck", "checkpoint.save_every=1",
                       *SPIKES])
    assert [m["skipped"] for m in straight] == [False] * 5 + [True, False, False]
    assert straight[5]["grad_norm"] > 50
    five, six = (dcp.read_whole(f"{tmp_path}/ck/step_0000000{i}", "") for i in (5, 6))
    assert all(torch.equal(five[k], six[k]) for k in five)
    resumed = _train([f"train.out_dir={tmp_path}/b", f"checkpoint.load={tmp_path}/ck/step_00000004", *SPIKES])
    keys = ("step", "loss", "grad_norm", "skipped")
    assert [[m[k] for k in keys] for m in resumed] == [[m[k] for k in keys] for m in straight[4:]]
    off = _train([f"train.out_dir={tmp_path}/c", *SPIKES, "train.skip_spikes=0"])
    assert not any(m["skipped"] for m in off)  # off: the spike is applied (clipped)


def test_a_nonfinite_gradient_the_norm_leaves_out_is_counted():
    """A copy the norm does not count (a tied embedding's on the last stage, a tp rank > 0's
    replicated one) still counts as non-finite: its nan would reach that rank's weights alone."""
    from tessera.optim.clip import grad_norm_and_nonfinite

    counted, copy = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))
    copy.shared_embedding = True
    grads = [(torch.full((3,), 2.0), counted), (torch.tensor([1.0, float("nan")]), copy)]
    norm, bad = grad_norm_and_nonfinite(grads, Topology.build(), count_nonfinite=True)
    assert norm.item() == pytest.approx(12 ** 0.5) and bad.item() == 1
    assert grad_norm_and_nonfinite(grads, Topology.build())[1] is None


def test_another_error_ends_the_run_without_a_rerun(tmp_path, monkeypatch):
    """Step 3's launch fails (Ctrl-C, a dead peer) while step 2, non-finite, is still unread:
    its line is written, but it is not re-run there (on many ranks the re-run's collectives
    would wait for ranks that already left)."""
    from tessera.training import trainer

    calls, real = [], trainer.train_step

    def step(*args, **kw):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*args, **kw)

    monkeypatch.setattr(trainer, "train_step", step)
    with pytest.raises(KeyboardInterrupt):
        _train([f"train.out_dir={tmp_path}", "train.inject_fault_step=2"])
    assert len(calls) == 3
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2
