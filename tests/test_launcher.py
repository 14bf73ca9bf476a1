"""tessera's launch (training/launcher.py): torchrun's command for one node or several, the launch's
options refused in words, the workers' statuses and pids it reads, and a job of two "nodes" on
this machine (two launchers meeting at a rendezvous on localhost) training as one node does."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest

from tessera.cli import main
from tessera.config import ConfigError
from tessera.testing import free_port
from tessera.training.launcher import check_launch, launching, torchrun_command


def _args(**given) -> argparse.Namespace:
    values = dict(command="train", config=None, overrides=["train.steps=3"], nproc_per_node=2, nnodes=1, node_rank=None,
                  rdzv_endpoint=None, rdzv_id=None, max_restarts=0)
    return argparse.Namespace(**(values | given))


def _after(command: list[str], flag: str) -> str:
    return command[command.index(flag) + 1]


def test_one_node_is_standalone_several_meet_at_a_c10d_rendezvous():
    one = torchrun_command(_args(max_restarts=3))
    assert "--standalone" in one and "--nnodes" not in one and _after(one, "--max-restarts") == "3"
    assert one[-5:] == ["-m", "tessera", "train", "--set", "train.steps=3"]
    assert _after(one, "--signals-to-handle") == "SIGINT,SIGHUP,SIGQUIT"  # (SIGTERM is the workers')
    several = torchrun_command(_args(nnodes=4, node_rank=0, rdzv_endpoint="node001:29500", rdzv_id="77"))
    assert "--standalone" not in several
    assert [_after(several, f) for f in ("--nnodes", "--rdzv-backend", "--rdzv-endpoint", "--rdzv-id", "--rdzv-conf")] \
        == ["4", "c10d", "node001:29500", "77", "is_host=true"]
    other = torchrun_command(_args(nnodes=4, node_rank=3, rdzv_endpoint="node001:29500"))
    assert _after(other, "--rdzv-conf") == "is_host=false" and _after(other, "--rdzv-id") == "tessera"
    assert "--rdzv-conf" not in torchrun_command(_args(nnodes=2, rdzv_endpoint="node001:29500"))


@pytest.mark.parametrize("given, key, words", [
    (dict(nnodes=2), "--rdzv-endpoint", "--nnodes 2 needs a rendezvous that every node reaches"),
    (dict(nnodes=2, node_rank=2, rdzv_endpoint="h:1"), "--node-rank", "2 is not below --nnodes 2"),
    (dict(rdzv_endpoint="node001"), "--rdzv-endpoint", "'node001' is not HOST:PORT"),
    (dict(rdzv_endpoint="node001:0"), "--rdzv-endpoint", "'node001:0' is not HOST:PORT"),
])
def test_a_launch_that_cannot_work_is_refused_in_words(given, key, words):
    with pytest.raises(ConfigError) as e:
        check_launch(_args(**given))
    assert e.value.key == key and words in e.value.problem


def test_the_launchs_options_need_a_launch(monkeypatch, capsys):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert launching(_args()) and not launching(_args(nproc_per_node=0))
    with pytest.raises(ConfigError, match="--max-restarts: is an option of tessera's own launch"):
        launching(_args(nproc_per_node=0, max_restarts=2))
    monkeypatch.setenv("LOCAL_RANK", "0")  # (a worker under torchrun)
    assert not launching(_args())
    with pytest.raises(ConfigError, match="this process runs under torchrun -> give it to torchrun instead"):
        launching(_args(nnodes=2))
    monkeypatch.delenv("LOCAL_RANK")
    assert main(["train", "--nnodes", "2", "--set", "train.steps=1"]) == 2
    assert capsys.readouterr().err.strip() == ("tessera: config error: --nnodes: is an option of tessera's own launch "
                                               "(--nproc-per-node) -> add --nproc-per-node N (processes per node), "
                                               "or leave --nnodes out")


# -- what the workers leave for the launcher ----------------------------------------------------------
def test_worker_statuses_are_read_from_the_last_attempt(tmp_path):
    from tessera.training.launcher import worker_status

    (tmp_path / "status.0.1").write_text("2")  # the first attempt's configuration error...
    assert worker_status(str(tmp_path), 1) == 2
    (tmp_path / "status.1.0").write_text("1")  # ...does not speak for a restarted attempt that crashed
    assert worker_status(str(tmp_path), 1) == 1
    (tmp_path / "status.1.1").write_text("3")
    assert worker_status(str(tmp_path), 1) == 3
    assert worker_status(str(tmp_path), 0) == 0
    (tmp_path / "pid.0").write_text("1")  # (other files are not statuses)
    assert worker_status(str(tmp_path), 1) == 3


def test_only_registered_pids_still_children_of_torchrun_are_signalled(tmp_path):
    from tessera.training.launcher import worker_pids

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (tmp_path / "pid.0").write_text(str(child.pid))
        (tmp_path / "pid.1").write_text(str(os.getpid()))  # (not a child of this process: never told)
        (tmp_path / "pid.2.tmp").write_text(str(child.pid))
        assert worker_pids(str(tmp_path), os.getpid()) == [child.pid]
    finally:
        child.kill()
        child.wait()
    assert worker_pids(str(tmp_path), os.getpid()) == []  # (gone)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_nodes_on_this_machine_train_as_one_node_does(tmp_path):
    """Two launchers, one process each, meet at a c10d rendezvous on localhost (--nnodes 2): the
    job is one of two ranks, and its losses are those of two ranks on one node (the trainer in
    two rank processes, as the workers of --nproc-per-node 2 run it)."""
    from training_runs import TINY, train_histories

    port = free_port()

    def tessera(out, *launch):
        sets = [a for s in TINY + ["data.source=synthetic", "train.steps=6", "train.log_every=1",
                                   f"train.out_dir={out}"] for a in ("--set", s)]
        return subprocess.Popen([sys.executable, "-m", "tessera", "train", *launch, *sets],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    rendezvous = ("--nnodes", "2", "--rdzv-endpoint", f"localhost:{port}", "--rdzv-id", "two-nodes")
    nodes = [tessera(tmp_path / "two", "--nproc-per-node", "1", *rendezvous, "--node-rank", str(r)) for r in (0, 1)]
    outs = []
    for proc in nodes:
        out, err = proc.communicate(timeout=500)
        assert proc.returncode == 0, out[-2000:] + err[-3000:]
        outs.append(out)
    assert sum("Topology(tp=1, cp=1, dp=2, pp=1; rank 0" in out for out in outs) == 1  # (one job of two ranks)
    two = [json.loads(line) for line in (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()]
    (one,) = train_histories(2, TINY, [["data.source=synthetic", "train.steps=6", "train.log_every=1",
                                        f"train.out_dir={tmp_path / 'one'}"]])
    keys = ("step", "loss", "grad_norm", "lr", "tokens")
    assert [[m[k] for k in keys] for m in two] == [[m[k] for k in keys] for m in one]
    assert len(two) == 6
