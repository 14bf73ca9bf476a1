"""The launcher (`tessera train --nproc-per-node N` hands over to torchrun: training/launcher.py): a SIGINT, SIGTERM, SIGHUP or
SIGQUIT sent to it alone reaches the launched command once, so stopping the launcher never leaves
workers behind."""

import os
import signal
import subprocess
import sys
import time

import pytest

from tessera.training.launcher import run_forwarding_signals

# (its handlers set before it says its pid: a signal forwarded at once finds them)
CHILD = ("import os, signal, sys, time; "
         "[signal.signal(s, lambda *_: sys.exit(7)) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, "
         "signal.SIGQUIT)]; "
         "print(os.getpid(), flush=True); time.sleep(600)")  # (outlives every wait below)
LAUNCHER = ("import sys; from tessera.training.launcher import run_forwarding_signals; "
            f"sys.exit(run_forwarding_signals([sys.executable, '-c', {CHILD!r}]))")


def _start(ignore_hangup: bool = False):
    """The launcher (SIGHUP ignored as under ``nohup`` where asked, else its default; SIGINT and
    SIGQUIT as in a foreground job, whatever the test runner's own dispositions: a suite run under
    nohup, or as a background job of a script, which ignores both) and its child's pid."""
    code = (f"import signal; signal.signal(signal.SIGHUP, signal.{'SIG_IGN' if ignore_hangup else 'SIG_DFL'}); "
            "signal.signal(signal.SIGINT, signal.default_int_handler); "
            "signal.signal(signal.SIGQUIT, signal.SIG_DFL); " + LAUNCHER)
    launcher = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                                env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    return launcher, int(launcher.stdout.readline())


def _alive(pid: int) -> bool:
    """Running (a zombie, dead but not yet reaped by whoever adopted it, counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:  # (no /proc: the kill above said it exists)
        return True


@pytest.mark.timeout(180)
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT])
def test_a_signal_to_the_launcher_stops_what_it_launched(sig):
    launcher, child = _start()
    try:
        # In a session of its own: a terminal's Ctrl-C reaches the launcher only, which passes it
        # on once (twice, the second would interrupt torchrun's shutdown of its workers).
        assert os.getsid(child) != os.getsid(launcher.pid)
        launcher.send_signal(sig)  # to the launcher only, as `kill` or a container runtime sends it
        assert launcher.wait(timeout=60) == 7, "the launcher should return the child's exit status"
        deadline = time.monotonic() + 60  # (generous: it is gone at once)
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(child), "the launched command outlived its launcher"
    finally:
        for pid in (child, launcher.pid):
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.timeout(180)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_a_launcher_killed_outright_still_stops_what_it_launched():
    launcher, child = _start()
    try:
        launcher.kill()  # SIGKILL (an out-of-memory kill, kill -9): nothing can be passed on
        launcher.wait(timeout=60)
        deadline = time.monotonic() + 60  # (generous: it is gone at once)
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(child), "the launched command outlived its launcher"
    finally:
        if _alive(child):
            os.kill(child, signal.SIGKILL)


@pytest.mark.timeout(180)
def test_a_hangup_the_launcher_ignores_is_not_passed_on():
    launcher, child = _start(ignore_hangup=True)  # nohup tessera train ...: a logout must not stop it
    try:
        launcher.send_signal(signal.SIGHUP)
        time.sleep(1.0)
        assert launcher.poll() is None and _alive(child)
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(timeout=60) == 7
    finally:
        for pid in (child, launcher.pid):
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_the_launched_commands_exit_status_is_returned():
    assert run_forwarding_signals([sys.executable, "-c", "import sys; sys.exit(3)"]) == 3
    killed = "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"
    assert run_forwarding_signals([sys.executable, "-c", killed]) == 128 + signal.SIGKILL
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handlers put back


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_ctrl_c_ends_a_run_with_one_line(tmp_path):
    from training_runs import TINY

    sets = [a for s in TINY + ["train.steps=100000", "train.log_every=1", f"train.out_dir={tmp_path}"]
            for a in ("--set", s)]
    run = subprocess.Popen([sys.executable, "-m", "tessera", "train", *sets], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    try:
        assert run.stdout.readline().startswith("tessera: ")  # (built: the model's line)
        while "step" not in run.stdout.readline():  # training
            pass
        run.send_signal(signal.SIGINT)
        _, err = run.communicate(timeout=60)
    finally:
        run.kill()
    assert run.returncode == 130 and err.strip().splitlines() == ["tessera: interrupted"], err[-2000:]


# (the launcher's refusals in this process, cli.main as torchrun's parent runs it: a refusal that
# failed to come would start torchrun and its workers, and the status and line would be theirs)
def test_the_launcher_refuses_an_out_dir_a_running_run_holds(tmp_path, capsys):
    from tessera.cli import main
    from tessera.training.metrics import lock_out_dir

    held = lock_out_dir(tmp_path)  # a run writing there now
    try:
        code = main(["train", "--nproc-per-node", "2", "--set", f"train.out_dir={tmp_path}"])
    finally:
        held.close()
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"tessera: config error: train.out_dir: {tmp_path} is in use by another run (host ")


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks a CPU machine's refusal")
def test_the_launcher_refuses_cuda_graphs_on_a_cpu_machine_in_one_line(tmp_path, capsys):
    from tessera.cli import main

    # (it was found by each worker, after the launch)
    code = main(["train", "--nproc-per-node", "2", "--set", "train.cuda_graphs=true", "--set", f"train.out_dir={tmp_path}"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith("tessera: config error: train.cuda_graphs: CUDA graphs need a CUDA device")


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_two_launches_on_one_machine_do_not_collide(tmp_path):
    """Each launch's rendezvous takes a free local port (torchrun --standalone): two runs started
    together on one machine both train (torch 2.11's torchrun, on its fixed default port, failed
    the second with "address already in use")."""
    sets = ["data.source=synthetic", "model.layers=2", "model.hidden=32", "model.heads=2", "model.seq_len=16",
            "train.steps=2", "train.micro_batch=1", "train.global_batch=2", "train.sample_tokens=0"]
    runs = [subprocess.Popen([sys.executable, "-m", "tessera", "train", "--nproc-per-node", "2",
                              *(a for s in sets + [f"train.out_dir={tmp_path / str(i)}"] for a in ("--set", s))],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    outs = [run.communicate(timeout=200)[0] for run in runs]
    for i, (run, out) in enumerate(zip(runs, outs)):
        assert run.returncode == 0, out[-2000:]
        assert len((tmp_path / str(i) / "metrics.jsonl").read_text().splitlines()) == 2
