"""What the GPU tests share: a `tessera train` run on the GPU machine, killed whole on a timeout,
and the checks that one run's loss curve follows another's."""

import json
import os
import signal
import subprocess
import sys

import pytest


def train_run(tmp_path, name, nproc, extra, timeout=150):
    """One `tessera train` run's metrics. On a timeout the whole process group (launcher,
    torchrun, workers) is killed, so the GPUs are free for the next run, and the failure carries
    the tail of what the run printed."""
    sets = ["model.hidden=128", "model.layers=2", "model.heads=4", "model.seq_len=64", "train.steps=8",
            "train.micro_batch=2", "train.global_batch=8", "data.source=synthetic", f"train.out_dir={tmp_path / name}",
            *extra]
    command = [sys.executable, "-m", "tessera", "train", "--nproc-per-node", str(nproc)]
    returncode, out = run_killable(command + [a for s in sets for a in ("--set", s)], name, timeout)
    assert returncode == 0, out[-3000:]
    (tmp_path / name / "output.log").write_text(out)
    return [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]


def run_killable(command: list[str], name: str, timeout: float) -> tuple[int, str]:
    """(return code, output) of ``command``; on a timeout its whole process group is killed
    and the failure carries the tail of what it printed."""
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"{name}: no result in {timeout} s:\n{out[-3000:]}") from None
    finally:  # also when pytest's own timeout interrupts the wait: the GPUs are freed for the next test
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, out


def all_follow(tmp_path, one, runs: dict, timeout=150):
    """Every 2-GPU variant in ``runs`` ({name: overrides}) follows ``one``; each runs even after
    another failed or timed out, so one GPU call names every failure."""
    failed = []
    for name, sets in runs.items():
        try:
            follows(one, train_run(tmp_path, name, 2, sets, timeout=timeout))
        except Exception as e:  # noqa: BLE001 -- a timeout too
            failed.append(f"{name}: {type(e).__name__}: {str(e)[-500:]}")
    assert not failed, "\n".join(failed)


def follows(one, curve, rel=1e-4):
    assert len(curve) == len(one), f"{len(curve)} steps logged, not {len(one)}"
    for a, b in zip(one, curve):
        assert b["loss"] == pytest.approx(a["loss"], rel=rel), (a["step"], a["loss"], b["loss"])
