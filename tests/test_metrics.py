"""metrics.jsonl: an earlier run's file is kept aside, never appended to; a second run into a
running run's out_dir is refused; non-finite values are written as JSON null; an out_dir that is a
file is refused before any work; the last step's line is printed."""

import io
import json
import math
import os

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
    from tessera.training.trainer import check_runnable

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
    from tessera.training.trainer import check_runnable

    (tmp_path / "afile").write_text("x")
    with pytest.raises(ConfigError, match="data.cache_dir: .*afile is a file"):  # (a traceback where it was made)
        check_runnable(load_config(None, [f"data.cache_dir={tmp_path / 'afile' / 'cache'}"]), 1)
    check_runnable(load_config(None, [f"data.cache_dir={tmp_path / 'cache'}"]), 1)
