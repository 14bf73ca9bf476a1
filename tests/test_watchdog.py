"""The step watchdog (training/watchdog.py): a hung training step ends the job with every
thread's stack, a slow but steady run does not."""

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tessera.training.watchdog import StepWatchdog

ROOT = Path(__file__).resolve().parents[1]


def _watchdog(timeout_s: float):
    log, now = [], [0.0]
    dog = StepWatchdog(timeout_s, arm=lambda s: log.append(("arm", s)), disarm=lambda: log.append("disarm"),
                       clock=lambda: now[0])
    return dog, log, now


def test_the_first_step_is_not_timed_and_the_limit_follows_the_slowest_step():
    dog, log, now = _watchdog(10.0)
    with dog:
        dog.tick()  # step 0: compiles, warms up; not timed
        assert log == []
        now[0] = 600.0  # step 0 took 600 s: not counted
        dog.tick()
        assert log == [("arm", 10.0)] and dog.slowest == 0.0
        now[0] = 601.0  # step 1: 1 s
        dog.tick()
        assert log[-1] == ("arm", 10.0) and dog.slowest == 1.0
        now[0] = 604.0  # step 2: 3 s -> limit 5 x 3 s
        dog.tick()
        assert log[-1] == ("arm", 15.0) and dog.slowest == 3.0
        now[0] = 605.0  # a faster step keeps the slowest
        dog.tick()
        assert log[-1] == ("arm", 15.0)
    assert log[-1] == "disarm"


def test_a_paused_block_is_not_timed_nor_counted_into_its_step():
    """A checkpoint's save runs under ``paused()``: the timer is off during it, on again after,
    and the step's time (the next limit) leaves it out."""
    dog, log, now = _watchdog(10.0)
    with dog:
        dog.tick()
        now[0] = 1.0
        dog.tick()  # step 1 starts at 1 s
        now[0] = 2.0
        with dog.paused():  # a 500 s save
            assert log[-1] == "disarm"
            now[0] = 502.0
        assert log[-1] == ("arm", 10.0)
        now[0] = 503.0
        dog.tick()  # step 1: 2 s of work, the save left out
        assert dog.slowest == 2.0 and log[-1] == ("arm", 10.0)


def test_a_one_step_run_times_only_its_tail_and_a_bad_timeout_is_refused():
    dog, log, _ = _watchdog(7.0)
    with dog:
        dog.tick()
        dog.tick()  # the tail
    assert log == [("arm", 7.0), "disarm"]
    dog, log, _ = _watchdog(7.0)
    with dog:
        dog.tick()
    assert log == []  # never armed, nothing to cancel
    for bad in (0, -1.0, float("nan"), float("inf"), 2e9):
        with pytest.raises(ValueError, match=r"seconds in \(0, 1e9\]"):
            StepWatchdog(bad)


_HANG = textwrap.dedent("""
    import sys, time
    from tessera.config import load_config
    from tessera.training import trainer
    real, calls = trainer.train_step, [0]
    def step(*args, **kwargs):
        calls[0] += 1
        if calls[0] == int(sys.argv[1]):
            print("hanging now", flush=True)
            time.sleep(float(sys.argv[2]))
        return real(*args, **kwargs)
    trainer.train_step = step
    sets = ["model.hidden=32", "model.heads=2", "model.layers=1", "model.seq_len=16", "model.vocab_size=256",
            "train.dtype=fp32", "train.micro_batch=2", "train.global_batch=2", "train.steps=6",
            "train.sample_tokens=0", "train.log_every=1", "train.timeout_s=" + sys.argv[3],
            "train.out_dir=" + sys.argv[4]]
    trainer.train(load_config(None, sets))
    print("finished", flush=True)
""")


def _start(folder, hang_at: int, seconds: float, timeout_s: float) -> subprocess.Popen:
    """The trainer in a process of its own (the watchdog ends it), step ``hang_at`` sleeping
    ``seconds``, under ``train.timeout_s``."""
    # (one thread each: the two run side by side on as few as 2 cores)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-c", _HANG, str(hang_at), str(seconds), str(timeout_s), str(folder)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Both runs, started together (each a process of its own, mostly importing torch): a hang of
    100 s in step 2 under a 2 s limit, and a step 4 slower by 1 s under a 60 s limit."""
    procs = {"hung": _start(tmp_path_factory.mktemp("hung"), 2, 100, 2),
             "slow": _start(tmp_path_factory.mktemp("slow"), 4, 1.0, 60)}
    done = {}

    def result(name: str) -> subprocess.CompletedProcess:
        if name not in done:
            try:
                out, err = procs[name].communicate(timeout=240)
            finally:
                procs[name].kill()
            done[name] = subprocess.CompletedProcess(procs[name].args, procs[name].returncode, out, err)
        return done[name]
    yield result
    for proc in procs.values():
        proc.kill()
        proc.wait()


@pytest.mark.slow
def test_a_hung_step_ends_the_run_with_every_threads_stack(runs):
    """The second step (the first one timed: steps before it, slow on a loaded machine, cannot
    end the run first) sleeps 100 s (a hang) under a 2 s limit: the run ends in that step with
    exit code 1, the timer's message and the stack dumped naming where the main thread stood.
    (The sleep ending first would print "finished".)"""
    out = runs("hung")
    assert "hanging now" in out.stdout and "finished" not in out.stdout
    assert out.returncode != 0, out.returncode
    assert "Timeout (0:00:02)!" in out.stderr, out.stderr[-2000:]  # (no step timed before it: the limit is 2 s)
    assert "in step" in out.stderr and re.search(r'trainer\.py", line \d+ in run\n', out.stderr), out.stderr[-2000:]


@pytest.mark.slow
def test_a_slow_step_within_its_limit_does_not_end_the_run(runs):
    """A step 1 s slower than the others, well under its limit (60 s: a loaded machine's steps
    stay far below it): the run finishes. The limit's arithmetic is tested above on a clock of
    the test's own."""
    out = runs("slow")
    assert out.returncode == 0 and "finished" in out.stdout, out.stderr[-2000:]
