"""metrics.jsonl: an earlier run's file is kept aside, never appended to; non-finite values are
written as JSON null; an out_dir that is a file is refused before any work."""

import io
import json
import math

import pytest

from tessera.config import ConfigError, load_config
from tessera.training.metrics import JsonlLogger


def _metrics(step, loss=1.5, grad_norm=0.5):
    return {"step": step, "loss": loss, "grad_norm": grad_norm, "lr": 1e-3, "tokens_per_s": 10.0}


def test_an_earlier_runs_metrics_are_kept_aside(tmp_path):
    out = io.StringIO()
    first = JsonlLogger(tmp_path, 1, stream=out)
    first.log(_metrics(1))
    first.log(_metrics(2))
    second = JsonlLogger(tmp_path, 1, stream=out)
    assert "kept as" in out.getvalue() and "metrics.1.jsonl" in out.getvalue()
    second.log(_metrics(1))
    JsonlLogger(tmp_path, 1, stream=out).log(_metrics(1))
    steps = lambda name: [json.loads(x)["step"] for x in (tmp_path / name).read_text().splitlines()]
    assert steps("metrics.1.jsonl") == [1, 2] and steps("metrics.2.jsonl") == [1] and steps("metrics.jsonl") == [1]
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "metrics.jsonl").write_text("")
    JsonlLogger(empty, 1, stream=out)
    assert not (empty / "metrics.1.jsonl").exists(), "an empty file holds nothing to keep"


def test_non_finite_values_are_written_as_null(tmp_path):
    logger = JsonlLogger(tmp_path, 1, stream=io.StringIO())
    logger.log(_metrics(1, loss=math.nan, grad_norm=math.inf))
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
