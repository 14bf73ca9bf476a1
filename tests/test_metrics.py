"""metrics.jsonl: an earlier run's file is kept aside, never appended to; a second run into a
running run's out_dir is refused; non-finite values are written as JSON null; an out_dir that is a
file is refused before any work; the last step's line is printed; train.tensorboard writes the
same figures as TensorBoard scalars, a folder per run, and is refused up front without the package."""

import importlib.util
import io
import json
import math
import os
import sys

import pytest

from tessera.config import ConfigError, load_config
from tessera.training.metrics import JsonlLogger, check_out_dir_free


def _metrics(step, loss=1.5, grad_norm=0.5):
    return {"step": step, "loss": loss, "grad_norm": grad_norm, "lr": 1e-3, "tokens_per_s": 10.0}


def _logged(tmp_path, *steps, out=None):
    logger = JsonlLogger(tmp_path, 1, stream=out or io.StringIO())
    for step in steps:
        logger.log(_metrics(step))
    logger.close()


def _steps(path):
    return [json.loads(x)["step"] for x in path.read_text().splitlines()]


def test_an_earlier_runs_metrics_are_kept_aside(tmp_path):
    out = io.StringIO()
    _logged(tmp_path, 1, 2, out=out)
    _logged(tmp_path, 1, out=out)
    assert "kept as" in out.getvalue() and "metrics.1.jsonl" in out.getvalue()
    _logged(tmp_path, 1, out=out)
    assert _steps(tmp_path / "metrics.1.jsonl") == [1, 2] and _steps(tmp_path / "metrics.2.jsonl") == [1]
    assert _steps(tmp_path / "metrics.jsonl") == [1]
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "metrics.jsonl").write_text("")
    JsonlLogger(empty, 1, stream=out).close()
    assert not (empty / "metrics.1.jsonl").exists(), "an empty file holds nothing to keep"


def test_a_second_run_into_a_running_runs_out_dir_is_refused(tmp_path):
    """It renamed the running run's file, and their lines then interleaved in the new one."""
    first = JsonlLogger(tmp_path, 1, stream=io.StringIO())
    first.log(_metrics(1))
    with pytest.raises(ConfigError) as info:
        JsonlLogger(tmp_path, 1, stream=io.StringIO())
    assert info.value.key == "train.out_dir" and f"pid {os.getpid()}" in str(info.value)
    with pytest.raises(ConfigError):
        check_out_dir_free(tmp_path)  # the launcher's early check
    first.log(_metrics(2))
    first.close()
    assert _steps(tmp_path / "metrics.jsonl") == [1, 2] and not (tmp_path / "metrics.1.jsonl").exists()
    check_out_dir_free(tmp_path)
    _logged(tmp_path, 1)  # once it has ended, the next run may write there (keeping the first's aside)
    assert _steps(tmp_path / "metrics.1.jsonl") == [1, 2]


def test_a_moved_file_keeps_the_runs_later_lines(tmp_path):
    logger = JsonlLogger(tmp_path, 1, stream=io.StringIO())
    logger.log(_metrics(1))
    (tmp_path / "metrics.jsonl").rename(tmp_path / "moved.jsonl")
    logger.log(_metrics(2))
    logger.close()
    assert _steps(tmp_path / "moved.jsonl") == [1, 2]


def test_the_last_step_is_printed_when_log_every_skips_it(tmp_path):
    out = io.StringIO()
    logger = JsonlLogger(tmp_path, 3, stream=out)
    for step in range(1, 6):
        logger.log(_metrics(step))
    logger.print_last()
    logger.print_last()
    logger.close()
    assert [line.split()[1] for line in out.getvalue().splitlines()] == ["1", "3", "5"]


def test_non_finite_values_are_written_as_null(tmp_path):
    logger = JsonlLogger(tmp_path, 1, stream=io.StringIO())
    logger.log(_metrics(1, loss=math.nan, grad_norm=math.inf))
    logger.close()
    line = (tmp_path / "metrics.jsonl").read_text()
    assert "NaN" not in line and "Infinity" not in line
    assert json.loads(line)["loss"] is None and json.loads(line)["grad_norm"] is None


def test_out_dir_that_is_a_file_is_refused(tmp_path):
    from tessera.training.preflight import check_runnable

    (tmp_path / "afile").write_text("x")
    for out_dir in (tmp_path / "afile", tmp_path / "afile" / "run" / "deeper"):
        with pytest.raises(ConfigError, match="train.out_dir: .*afile is a file"):
            check_runnable(load_config(None, [f"train.out_dir={out_dir}"]), 1)
    check_runnable(load_config(None, [f"train.out_dir={tmp_path / 'new' / 'run'}"]), 1)


def test_the_runs_configuration_is_kept_beside_its_metrics(tmp_path):
    """config.toml holds the resolved configuration, read back by --config to the same Config; an
    earlier run's pair is kept aside under one number."""
    from tessera.config import to_dict

    cfg = load_config(None, ["model.hidden=96", "data.paths=0.5,a,0.5,b", "optim.lr=3e-4", "train.out_dir=x y"])
    logger = JsonlLogger(tmp_path, 1, stream=io.StringIO(), config=to_dict(cfg))
    logger.log(_metrics(1))
    logger.close()
    assert load_config(str(tmp_path / "config.toml"), []) == cfg
    second = load_config(None, ["model.hidden=64"])
    JsonlLogger(tmp_path, 1, stream=io.StringIO(), config=to_dict(second)).close()
    assert load_config(str(tmp_path / "config.1.toml"), []) == cfg and (tmp_path / "metrics.1.jsonl").exists()
    assert load_config(str(tmp_path / "config.toml"), []) == second
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == [
        "config.1.toml", "config.toml", "metrics.1.jsonl", "metrics.jsonl"]


def test_a_cache_dir_that_cannot_be_a_directory_is_refused(tmp_path):
    from tessera.training.preflight import check_runnable

    (tmp_path / "afile").write_text("x")
    with pytest.raises(ConfigError, match="data.cache_dir: .*afile is a file"):  # (a traceback where it was made)
        check_runnable(load_config(None, [f"data.cache_dir={tmp_path / 'afile' / 'cache'}"]), 1)
    check_runnable(load_config(None, [f"data.cache_dir={tmp_path / 'cache'}"]), 1)


TINY = ["train.device=cpu", "data.source=synthetic", "model.layers=1", "model.hidden=32", "model.heads=2",
        "model.seq_len=16", "model.vocab_size=64", "train.micro_batch=1", "train.global_batch=2",
        "train.sample_tokens=0", "train.tensorboard=true", "optim.warmup=2"]


# a test extra (pyproject.toml): a GPU machine's own python, offline, may lack it
needs_tensorboard = pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None, reason="needs tensorboard")


def _scalars(folder):
    """{tag: {step: value}} of the TensorBoard event files in ``folder``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()
    return {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}


@needs_tensorboard
@pytest.mark.timeout(120)
def test_tensorboard_scalars_are_the_runs_metrics_a_folder_per_run(tmp_path):
    """Each step's figures at that step, equal to metrics.jsonl's (float32 in the event file); a
    second run into the same out_dir writes a folder of its own, numbered as the first run's
    metrics.N.jsonl, so the first run's curves stay as they were."""
    from tessera.training.trainer import train

    out = tmp_path / "out"
    train(load_config(None, TINY + ["train.steps=3", "train.eval_every=2", "optim.lr=1e-2", f"train.out_dir={out}"]))
    first = _scalars(out / "tensorboard" / "run-1")
    train(load_config(None, TINY + ["train.steps=2", "optim.lr=3e-3", f"train.out_dir={out}"]))
    assert sorted(p.name for p in (out / "tensorboard").iterdir()) == ["run-1", "run-2"]
    assert _scalars(out / "tensorboard" / "run-1") == first
    tags = {"loss": "train/loss", "lr": "train/lr", "grad_norm": "train/grad_norm", "tokens": "train/tokens",
            "valid_loss": "valid/loss", "forward_backward_s_max": "train/forward_backward_s_max"}
    for run, metrics, validated in (("run-1", "metrics.1.jsonl", [2, 3]), ("run-2", "metrics.jsonl", [])):
        scalars, logged = _scalars(out / "tensorboard" / run), [json.loads(x) for x in (out / metrics).read_text().splitlines()]
        assert [m["step"] for m in logged if "valid_loss" in m] == validated
        for key, tag in tags.items():
            assert scalars.get(tag, {}) == pytest.approx({m["step"]: m[key] for m in logged if key in m}, rel=1e-6), (run, tag)
        assert len(set(scalars["train/lr"].values())) > 1 and "train/step" not in scalars  # (warmup: an lr per step)
        assert list(scalars["train/forward_backward_s_max"]) == [len(logged)]  # (timers: at the last step here)


@needs_tensorboard
def test_tensorboard_writes_booleans_as_0_1_and_leaves_non_finite_values_out(tmp_path):
    logger = JsonlLogger(tmp_path, 1, stream=io.StringIO(), tensorboard=True)
    logger.log({**_metrics(1, loss=math.nan, grad_norm=math.inf), "loss_scale": 1024.0, "skipped": True})
    logger.log({**_metrics(2), "loss_scale": 512.0, "skipped": False, "valid_loss": 2.0, "valid_ppl": math.exp(2.0)})
    logger.close()
    scalars = _scalars(tmp_path / "tensorboard" / "run-1")
    assert scalars["train/loss"] == {2: 1.5} and scalars["train/grad_norm"] == {2: 0.5}
    assert scalars["train/skipped"] == {1: 1.0, 2: 0.0} and scalars["train/loss_scale"] == {1: 1024.0, 2: 512.0}
    assert scalars["valid/loss"] == {2: 2.0} and scalars["valid/ppl"] == {2: pytest.approx(math.exp(2.0))}


def test_tensorboard_without_the_package_is_refused_before_any_work(tmp_path, monkeypatch):
    from tessera.training.trainer import train

    monkeypatch.setitem(sys.modules, "tensorboard", None)  # (import tensorboard: ImportError)
    monkeypatch.delitem(sys.modules, "torch.utils.tensorboard", raising=False)
    out = tmp_path / "out"
    with pytest.raises(ConfigError) as info:
        train(load_config(None, TINY + ["train.steps=1", f"train.out_dir={out}"]))
    assert info.value.key == "train.tensorboard" and "pip install tensorboard" in info.value.fix
    assert not out.exists()


def test_an_out_dir_that_cannot_be_made_is_refused_in_words(tmp_path):
    """A folder the system will not make (here: below /proc, which even root cannot write) is a
    config error naming the key, not a traceback."""
    from tessera.training.metrics import lock_out_dir

    for key in ("train.out_dir", "checkpoint.dir"):
        with pytest.raises(ConfigError, match=f"{key}: cannot make /proc/tessera-test a folder"):
            lock_out_dir("/proc/tessera-test", key)
