"""The training loop's order of work: each step read after the next is launched, the step
before a failure still logged, the layers' graphs released however the run ends."""

import contextlib
import dataclasses
import json

import pytest

from tessera.config import load_config


def test_trainer_releases_the_layer_graphs_after_training_and_after_an_error(monkeypatch, tmp_path):
    """Whatever ends the run, the trainer frees the captured graphs before returning (the CLI
    then destroys the process group, which hangs while graphs with NCCL work live). Capture is
    stood in for on CPU; the GPU tests run the real one."""
    from tessera.training import build, trainer

    log = []

    class Recorded:
        released = 0

        def release(self):
            Recorded.released += 1
            log.append("released")

    @contextlib.contextmanager
    def step_stream(device):  # (the capture and the steps run on a stream of their own)
        log.append("stream")
        try:
            yield
        finally:
            log.append("stream put back")

    monkeypatch.setenv("WORLD_SIZE", "1")
    make_plan = trainer.make_plan
    monkeypatch.setattr(trainer, "make_plan", lambda cfg, device, tp=None: dataclasses.replace(make_plan(cfg, device, tp),
                                                                                               graphed=True))
    monkeypatch.setattr(trainer, "step_stream", step_stream)
    monkeypatch.setattr(build, "graph_stage",
                        lambda chunks, cfg, data_parallel=None, fused=False: log.append("captured") or [Recorded()])
    sets = ["train.device=cpu", "data.source=synthetic", "model.layers=2", "model.hidden=32", "model.heads=2",
            "model.seq_len=16", "model.vocab_size=64", "train.steps=2", "train.micro_batch=1",
            "train.global_batch=2", "train.sample_tokens=0", f"train.out_dir={tmp_path}"]
    history = trainer.train(load_config(None, sets))
    assert len(history) == 2 and Recorded.released == 1
    assert log == ["stream", "captured", "released", "stream put back"]
    assert all(m["step_time_s"] > 0 for m in history)  # the real step on the host clock

    def broken(*args):
        raise RuntimeError("a step failed")

    monkeypatch.setattr(trainer.Trainer, "run", broken)
    with pytest.raises(RuntimeError, match="a step failed"):
        trainer.train(load_config(None, sets))
    assert Recorded.released == 2 and log[4:] == ["stream", "captured", "released", "stream put back"]

    class Failing(Recorded):  # (a CUDA error in its synchronize)
        def release(self):
            super().release()
            raise RuntimeError("a release failed")

    # two sets: the second is released although the first's release failed
    monkeypatch.setattr(build, "graph_stage", lambda chunks, cfg, data_parallel=None, fused=False: [Failing(), Recorded()])
    monkeypatch.setattr(trainer.Trainer, "run", lambda *args: [])
    with pytest.raises(RuntimeError, match="a release failed"):
        trainer.train(load_config(None, sets))
    assert Recorded.released == 4


def test_trainer_reads_each_step_after_launching_the_next(monkeypatch, tmp_path):
    """The host never waits for step k before step k+1 is queued: the trainer reads a step's
    figures (which waits for its GPU work) only after launching the next, and still logs every
    step with its own learning rate."""
    from tessera.training import trainer

    events = []

    class Result:
        skipped, ready = False, None

        def __init__(self, step):
            self.step, self.finished_at = step, float(step + 1)  # each step "took" one second

        @property
        def tokens(self):
            events.append(f"read {self.step}")
            return 4

        loss = 1.0
        grad_norm = 0.5

    def fake_step(optimizer, micro_batches, *args, **kwargs):
        step = sum(e.startswith("launch") for e in events)
        events.append(f"launch {step}")
        return Result(step)

    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setattr(trainer, "train_step", fake_step)
    sets = ["train.device=cpu", "data.source=synthetic", "model.layers=1", "model.hidden=32", "model.heads=2",
            "model.seq_len=16", "model.vocab_size=64", "train.steps=3", "train.micro_batch=1",
            "train.global_batch=2", "train.sample_tokens=0", "optim.warmup=3", f"train.out_dir={tmp_path}"]
    history = trainer.train(load_config(None, sets))
    assert events == ["launch 0", "launch 1", "read 0", "launch 2", "read 1", "read 2"]
    assert [m["step"] for m in history] == [1, 2, 3]
    assert [m["step_time_s"] for m in history[1:]] == [1.0, 1.0]  # from one step's end to the next's
    assert history[0]["lr"] < history[1]["lr"] < history[2]["lr"]  # warm-up: each step logs its own


def test_a_failing_step_still_logs_the_step_before_it(monkeypatch, tmp_path):
    """Step k is read after step k+1 is launched; if that launch fails, step k's line is
    written before the error goes up."""
    from tessera.training import trainer

    class Result:
        skipped, ready, loss, grad_norm, tokens = False, None, 1.0, 0.5, 4

        def __init__(self, step):
            self.finished_at = float(step + 1)

    launches = []

    def fake_step(*args, **kwargs):
        launches.append(len(launches))
        if len(launches) == 3:
            raise RuntimeError("step 3 failed")
        return Result(len(launches) - 1)

    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setattr(trainer, "train_step", fake_step)
    sets = ["train.device=cpu", "data.source=synthetic", "model.layers=1", "model.hidden=32", "model.heads=2",
            "model.seq_len=16", "model.vocab_size=64", "train.steps=5", "train.micro_batch=1",
            "train.global_batch=2", "train.sample_tokens=0", f"train.out_dir={tmp_path}"]
    with pytest.raises(RuntimeError, match="step 3 failed"):
        trainer.train(load_config(None, sets))
    logged = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert logged == [1, 2]
