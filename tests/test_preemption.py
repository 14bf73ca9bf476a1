"""Stopping early and going on (training/preemption.py, training/launcher.py): a signal or the
wall-clock limit on one rank stops every rank after the same step, with a checkpoint; the same
run started again resumes and ends where an uninterrupted one does; a worker that dies brings the
job back from the newest checkpoint under torchrun's restarts.

The in-process tests make one rank ask at a known step (a clock the test gives, or a signal the
clock sends): no wall-clock thresholds. The command-line tests signal a running job from outside
and check what it left, whatever step the signal caught it at."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tessera.checkpoint import checkpoints
from tessera.config import load_config
from tessera.testing import run_ranks
from tessera.training.preemption import GO_ON, SIGNALLED, TIME_LIMIT, StopRequest

BASE = ["model.hidden=32", "model.layers=2", "model.heads=2", "model.seq_len=16", "model.vocab_size=64",
        "train.micro_batch=1", "train.global_batch=4", "train.seed=5", "train.log_every=2", "train.steps=8",
        "data.source=synthetic", "optim.lr=1e-2", "optim.warmup=2", "train.sample_tokens=0"]


class Clock:
    """A host clock for one rank: 0 until its ``at``-th call, then a day later (the wall-clock
    limit passed); or, with ``send``, that signal sent to this process at the ``at``-th call."""

    def __init__(self, at: int, send: int | None = None):
        self.calls, self.at, self.send = 0, at, send

    def __call__(self) -> float:
        self.calls += 1
        if self.send is not None:
            if self.calls == self.at:
                os.kill(os.getpid(), self.send)
            return 0.0
        return 0.0 if self.calls < self.at else 86400.0


def _stop_runs(rank: int, world: int, tmp: str) -> list:
    """Four runs of BASE on this rank: stopped by rank 0's clock, resumed, straight, stopped by a
    signal rank 0 sends itself. Each run's (history, printed text)."""
    from tessera.training.trainer import train

    def run(overrides, stop):
        out = io.StringIO()
        with contextlib.redirect_stdout(out), stop.install():
            history = train(load_config(None, BASE + ["parallel.pp=2"] + overrides), stop=stop)
        return history, out.getvalue()

    same = [f"checkpoint.dir={tmp}/ck", f"train.out_dir={tmp}/out", "train.exit_after_minutes=1"]
    # votes: one before the loop, one per step launched: rank 0's 4th is step 3's
    clock = Clock(at=4) if rank == 0 else Clock(at=10**9)
    stopped = run(same, StopRequest(clock=clock, started=0.0))
    resumed = run(same, StopRequest())
    straight = run([f"checkpoint.dir={tmp}/straight", f"train.out_dir={tmp}/out2"], StopRequest())
    # the signal arrives during rank 0's 4th vote, which already read "go on": the 5th says stop
    signalled = run([f"train.out_dir={tmp}/out3", f"checkpoint.dir={tmp}/sig", "train.exit_after_minutes=1"],
                    StopRequest(clock=Clock(at=4, send=signal.SIGUSR1), started=0.0) if rank == 0 else StopRequest())
    return [stopped, resumed, straight, signalled]


@pytest.mark.timeout(300)
def test_the_ranks_stop_after_the_same_step_save_and_the_run_resumes(tmp_path):
    """Rank 0 (the first pipeline stage) alone passes its limit while step 3 is launched; every
    rank reads that vote with step 3's figures, after launching step 4, so all finish step 4,
    save it and return. Started again, the run resumes from it and ends as a straight run does."""
    by_rank = run_ranks(_stop_runs, 2, str(tmp_path), timeout=280)
    (stopped, said), (resumed, said_resumed), (straight, _), (signalled, said_signal) = by_rank[1]  # (it logs)
    assert [m["step"] for m in stopped] == [1, 2, 3, 4]
    assert (f"tessera: stopped after step 4 of 8 (train.exit_after_minutes=1 reached): saved "
            f"{tmp_path}/ck/step_00000004; the same command resumes from it") in said
    assert [step for step, _ in checkpoints(f"{tmp_path}/ck")] == [4, 8]
    assert "resumed from" in said_resumed and [m["step"] for m in resumed] == [5, 6, 7, 8]
    keys = ("step", "loss", "grad_norm", "lr")
    assert [[m[k] for k in keys] for m in stopped + resumed] == [[m[k] for k in keys] for m in straight]
    assert by_rank[0][0][0] == []  # (rank 0 does not log)
    assert [m["step"] for m in signalled] == [1, 2, 3, 4, 5]
    assert f"tessera: stopped after step 5 of 8 (a stop signal to another rank): saved {tmp_path}/sig/step_00000005" \
        in said_signal
    assert "tessera: stopped" not in by_rank[1][2][1]  # (the straight run ran to its end)


def test_a_stop_without_a_checkpoint_dir_says_nothing_was_saved(tmp_path, capsys, monkeypatch):
    from tessera.training.trainer import train

    monkeypatch.setenv("WORLD_SIZE", "1")
    cfg = load_config(None, BASE + [f"train.out_dir={tmp_path}", "train.exit_after_minutes=1"])
    history = train(cfg, stop=StopRequest(clock=Clock(at=3), started=0.0))  # (step 1's vote passes the limit)
    assert [m["step"] for m in history] == [1, 2, 3]
    out = capsys.readouterr().out
    assert ("tessera: stopped after step 3 of 8 (train.exit_after_minutes=1 reached): checkpoint.dir is not set, "
            "so nothing was saved") in out
    early = StopRequest()
    early.ask(signal.SIGTERM)  # (during the build: one vote before the loop stops it before any step)
    assert train(load_config(None, BASE + [f"train.out_dir={tmp_path}", f"checkpoint.dir={tmp_path}/ck"]),
                 stop=early) == []
    assert "tessera: stopped before step 1 of 8 (SIGTERM): no step was taken: nothing new to save" \
        in capsys.readouterr().out
    assert checkpoints(f"{tmp_path}/ck") == []


def test_a_stop_request_comes_from_a_signal_or_the_clock():
    now = [0.0]
    stop = StopRequest(limit_s=60, clock=lambda: now[0], started=0.0)
    assert stop.wish() == GO_ON
    now[0] = 60.0
    assert stop.wish() == TIME_LIMIT
    before = signal.getsignal(signal.SIGUSR1)
    with stop.install():
        os.kill(os.getpid(), signal.SIGUSR1)  # (the handler runs before the next line)
        assert stop.wish() == SIGNALLED and stop.signal == signal.SIGUSR1
    assert signal.getsignal(signal.SIGUSR1) is before  # put back
    assert StopRequest(limit_s=0, clock=lambda: 1e12, started=0.0).wish() == GO_ON  # (0: no limit)


# -- the command line ------------------------------------------------------------------------------------
def _tessera(tmp_path, sets, nproc=2, extra=(), **popen):
    from training_runs import TINY

    args = [a for s in TINY + sets for a in ("--set", s)]
    command = [sys.executable, "-m", "tessera", "train", "--nproc-per-node", str(nproc), *extra, *args]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)


def _metrics(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _wait_for_step(path, step: int, proc, deadline_s: float = 240) -> None:
    """Until ``path`` holds ``step``'s metrics (those of a run that started after step 1 too)."""
    deadline = time.monotonic() + deadline_s  # (generous: bounds a hang only)
    while not any(m["step"] == step for m in _metrics(path)):
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "the run did not reach the step"
        time.sleep(0.2)


def _descendants(pid: int) -> list[int]:
    """Every process under ``pid`` (Linux's /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                parent = int(open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()[1])
                children.setdefault(parent, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


# (the schedule pinned by optim.decay_steps: the command run again may then stop sooner, train.steps)
LONG = ["data.source=synthetic", "train.steps=400", "train.log_every=1", "checkpoint.save_every=1000",
        "optim.decay_steps=400"]


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds the job's processes in /proc")
def test_a_signalled_job_saves_exits_0_and_the_same_command_resumes(tmp_path):
    """SIGTERM to the launcher, then (to the resumed job) SIGUSR1 to every process, as Slurm
    sends it: each time the job saves, says so and exits 0, and the same command resumes from
    that checkpoint (the last time: its settings in two rank processes of the trainer, as
    torchrun's workers run them, to a shorter end)."""
    from training_runs import TINY, train_outputs

    sets = LONG + [f"train.out_dir={tmp_path}/out", f"checkpoint.dir={tmp_path}/ck"]
    metrics, saved, start = tmp_path / "out" / "metrics.jsonl", [], 0
    for how in ("SIGTERM to the launcher", "SIGUSR1 to every process (Slurm)"):
        run = _tessera(tmp_path, sets)
        try:
            _wait_for_step(metrics, start + 3, run)  # (3 steps of this launch)
            if how.startswith("SIGTERM"):
                run.send_signal(signal.SIGTERM)
            else:  # a job step's every process: the launcher, torchrun, the workers
                for pid in [run.pid, *_descendants(run.pid)]:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGUSR1)
            out, err = run.communicate(timeout=240)
        finally:
            run.kill()
        assert run.returncode == 0, (how, err[-3000:])
        if start:
            assert f"resumed from {tmp_path}/ck/step_{start:08d} at step {start}" in out, how
        done = _metrics(metrics)[-1]["step"]
        assert start + 3 <= done < 400, how
        saved.append(done)
        assert [step for step, _ in checkpoints(f"{tmp_path}/ck")] == saved, how
        assert f"tessera: stopped after step {done} of 400" in out and "the same command resumes from it" in out, how
        start = done
    (history, out), = train_outputs(2, TINY, [sets[:1] + ["train.steps=" + str(done + 2)] + sets[2:]])  # (a shorter rest)
    assert f"resumed from {tmp_path}/ck/step_{done:08d} at step {done}" in out
    assert [m["step"] for m in history] == [m["step"] for m in _metrics(metrics)] == [done + 1, done + 2]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_killed_worker_restarts_from_the_newest_checkpoint_with_the_same_losses(tmp_path):
    """train.inject_fault=kill: the last rank SIGKILLs itself as step 7 starts, in the first
    attempt only; torchrun (--max-restarts 1) restarts both workers, which resume from step 4's
    checkpoint and end as an uninterrupted run on the same layout does, to the bit (CPU; that
    one the trainer in two rank processes, as each torchrun worker runs it)."""
    from training_runs import TINY, train_histories

    common = ["data.source=synthetic", "train.steps=10", "train.log_every=1", "checkpoint.save_every=4"]
    killed = _tessera(tmp_path, common + [f"train.out_dir={tmp_path}/a", f"checkpoint.dir={tmp_path}/a/ck",
                                          "train.inject_fault=kill", "train.inject_fault_step=7"],
                      extra=("--max-restarts", "1"))
    out, err = killed.communicate(timeout=400)
    assert killed.returncode == 0, err[-3000:]
    assert f"resumed from {tmp_path}/a/ck/step_00000004 at step 4" in out
    first = _metrics(tmp_path / "a" / "metrics.1.jsonl")  # (the first attempt's, kept aside by the restart)
    after = _metrics(tmp_path / "a" / "metrics.jsonl")
    assert [m["step"] for m in first] == [1, 2, 3, 4, 5, 6] and after[0]["step"] == 5, (first, after)
    (straight,) = train_histories(2, TINY + common, [[f"train.out_dir={tmp_path}/b", f"checkpoint.dir={tmp_path}/b/ck"]])
    keys = ("step", "loss", "grad_norm", "lr")
    joined = [[m[k] for k in keys] for m in first[:4] + after]
    assert joined == [[m[k] for k in keys] for m in straight]
    assert [step for step, _ in checkpoints(f"{tmp_path}/a/ck")] == [4, 8, 10]
