"""configs/: every preset is a layout that runs (the checks that need no data or GPU, for the
world size it states), and its model has the published parameter count."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from tessera.checkpoint.store import whole_shapes
from tessera.config import load_config
from tessera.optim import LRScheduler
from tessera.training.preflight import check_pipeline, validate

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
# the published parameter counts (transformers' num_parameters() of the released models; GPT 1.3B:
# the GPT-3 paper's "1.3B")
PUBLISHED = {
    "gpt2-124m": 124_439_808,
    "gpt2-1.3b": 1.3e9,
    "llama3.2-1b": 1_235_814_400,
    "llama3.2-3b": 3_212_749_824,
    "llama3-8b": 8_030_261_248,
    "llama3-70b": 70_553_706_496,
}
PRESETS = sorted(p.stem for p in CONFIGS.glob("*.toml") if p.stem != "demo")


def test_every_preset_has_a_published_count():
    assert PRESETS == sorted(PUBLISHED)


@pytest.mark.parametrize("name", PRESETS)
def test_a_preset_runs_on_the_gpus_it_states(name):
    path = CONFIGS / f"{name}.toml"
    cfg = load_config(str(path), [])
    p = cfg.parallel
    assert p.dp, "a preset states its dp, so its world size is known"
    world = p.tp * p.cp * p.pp * p.dp
    header = path.read_text().split("\n[", 1)[0]
    assert f"for {world} GPUs" in header, f"{name}: its comment should say the layout is for {world} GPUs"
    assert re.search(r"^# Measured: ", header, re.MULTILINE), f"{name}: say what was measured, or 'not measured'"
    validate(cfg, world)  # sizes, divisibility, combinations
    check_pipeline(cfg)  # the layer split and the schedule, simulated for its micro-batch count
    LRScheduler(cfg.optim, cfg.train.steps)


@pytest.mark.parametrize("name", PRESETS)
def test_a_presets_model_has_the_published_parameter_count(name):
    cfg = load_config(str(CONFIGS / f"{name}.toml"), [])
    count = sum(math.prod(shape) for shape in whole_shapes(cfg.model).values())  # (the vocabulary unpadded)
    assert count == pytest.approx(PUBLISHED[name], rel=0.02), f"{name}: {count:,}"
    header = (CONFIGS / f"{name}.toml").read_text().split("\n[", 1)[0]
    assert f"{count:,}" in header, f"{name}: its comment should give the count, {count:,}"
