"""The validation loss (training/evaluate.py, ``train.eval_every``): it is the model's mean loss
per token over the validation samples, the same figure on every layout, and taking it leaves
training exactly as it was."""

from __future__ import annotations

import pytest
import torch

from parity import assert_same_curve
from tessera.checkpoint import dcp
from tessera.config import ConfigError, load_config
from training_runs import train_histories

BASE = ["model.hidden=32", "model.layers=4", "model.heads=4", "model.seq_len=16", "model.vocab_size=100",
        "train.micro_batch=1", "train.global_batch=8", "train.seed=5", "train.log_every=1", "train.steps=4",
        "data.source=synthetic", "optim.lr=1e-2", "optim.warmup=1", "train.eval_every=2", "train.eval_batches=2"]
# packed documents of the demo corpus: positions and attention restart at each end of document
PACKED = ["data.source=builtin", "model.vocab_size=256", "data.eod_id=0", "data.reset_position_ids=true",
          "data.reset_attention_mask=true", "data.eod_mask_loss=true"]


def histories(world, runs, timeout=240):
    """Each run's metrics (``BASE + overrides``, the trainer on ``world`` ranks)."""
    return train_histories(world, BASE, runs, timeout)


def valid(history):
    return [(m["step"], m["valid_loss"]) for m in history if "valid_loss" in m]


@pytest.mark.timeout(120)
def test_the_validation_loss_is_the_models_mean_loss_over_the_validation_samples(tmp_path):
    """After the last step: the saved model, run by hand over the validation samples (the
    synthetic data's own stream, not the training one's), gives the logged figure."""
    from tessera.models import GPTModel
    from tessera.training.data_feed import build_source

    history = histories(1, [[f"checkpoint.dir={tmp_path}/ck", f"train.out_dir={tmp_path}/out"]])[0]
    assert [s for s, _ in valid(history)] == [2, 4]
    cfg = load_config(None, BASE)
    model = GPTModel(cfg.model)
    whole = dcp.read_whole(f"{tmp_path}/ck/step_00000004")
    with torch.no_grad():
        for name, p in model.named_parameters():
            p[: whole["model." + name].shape[0]].copy_(whole["model." + name])  # (vocabulary padding rows stay)
    model.eval()
    source, train_source = build_source(cfg, split=1), build_source(cfg)
    assert not (source[0] == train_source[0]).all()
    rows = torch.from_numpy(__import__("numpy").stack([source[i] for i in range(2 * 8)]).astype("int64"))
    with torch.no_grad():
        losses = model(rows[:, :-1], labels=rows[:, 1:])
    assert valid(history)[-1][1] == pytest.approx(losses.double().mean().item(), rel=1e-6)


LAYOUTS = [
    (4, ["parallel.tp=2", "parallel.pp=2", "parallel.sequence_parallel=true"]),
    (4, ["parallel.pp=2", "parallel.vpp=2", "parallel.dp=2", "parallel.zero=1"]),
    (2, ["parallel.dp=2", "parallel.zero=3", "checkpoint.dir=CKPT"]),  # (a save after the eval: FSDP resharded)
]


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("data", ["synthetic", "packed"])
def test_every_layout_gives_the_same_validation_loss(tmp_path, data):
    extra = PACKED if data == "packed" else []
    out = tmp_path
    reference = histories(1, [extra + [f"train.out_dir={out}/one"]])[0]
    assert len(valid(reference)) == 2 and all(v > 0 for _, v in valid(reference))
    for i, (world, layout) in enumerate(LAYOUTS):
        layout = [s.replace("CKPT", f"{out}/ck{i}") for s in layout]
        got = histories(world, [extra + layout + [f"train.out_dir={out}/{i}"]])[0]
        assert [s for s, _ in valid(got)] == [s for s, _ in valid(reference)], layout
        assert [v for _, v in valid(got)] == pytest.approx([v for _, v in valid(reference)], rel=1e-5), layout
        assert_same_curve(reference, got, rel=1e-5, what=str(layout))  # the training between, norms too


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_taking_the_validation_loss_leaves_training_as_it_was(tmp_path):
    """Bit for bit, with dropout (eval mode draws no masks) at pp=2 x dp=2 under zero 1's
    overlapped parameter gather (the evaluation waits for it) and a packed corpus."""
    layout = ["parallel.pp=2", "parallel.dp=2", "parallel.zero=1", "model.dropout=0.1", *PACKED]
    on, off = histories(4, [layout + [f"train.out_dir={tmp_path}/on"],
                            layout + ["train.eval_every=0", f"train.out_dir={tmp_path}/off"]])
    keys = ("step", "loss", "grad_norm")
    assert [[m[k] for k in keys] for m in on] == [[m[k] for k in keys] for m in off]
    assert len(valid(on)) == 2 and not valid(off)


def test_a_validation_split_without_samples_is_refused(tmp_path):
    from tessera.training.preflight import check_runnable

    for overrides in (["data.source=builtin", "model.vocab_size=256", "data.split=1,0,0"],
                      ["train.eval_every=-1"], ["train.eval_batches=0"]):
        with pytest.raises(ConfigError) as err:
            check_runnable(load_config(None, BASE + overrides), 1)
        assert err.value.key in ("data.split", "train.eval_every", "train.eval_batches"), err.value
    with pytest.raises(ConfigError, match="no validation part"):
        check_runnable(load_config(None, BASE + ["data.source=builtin", "model.vocab_size=256", "data.split=1,0,0"]), 1)


@pytest.mark.timeout(120)
def test_the_step_after_a_validation_loss_or_a_save_is_timed_on_its_own(tmp_path, monkeypatch):
    """tokens/s and MFU of the step after a pause between steps (a validation loss, a checkpoint's
    save) are that step's, not the pause's. Timed on a clock of the test's own (the step clock's
    and the steps' finishing times): each step takes 1 s, each pause 100 s."""
    from tessera.checkpoint import dcp
    from tessera.training import trainer
    now, pauses = [0.0], []
    real_valid, real_write, real_step = trainer.validation_loss, dcp.write, trainer.train_step

    def pausing(fn, what):
        def pause(*args):
            now[0] += 100.0
            pauses.append(what)
            return fn(*args)
        return pause

    def one_second_step(*args, **kwargs):
        result = real_step(*args, **kwargs)
        now[0] += 1.0
        result.finished_at = now[0]
        return result
    monkeypatch.setattr(trainer, "train_step", one_second_step)
    monkeypatch.setattr(trainer, "validation_loss", pausing(real_valid, "valid"))
    monkeypatch.setattr(dcp, "write", pausing(real_write, "save"))
    history = trainer.train(load_config(None, BASE + ["train.steps=5", f"train.out_dir={tmp_path}/out",
                                                      f"checkpoint.dir={tmp_path}/ck", "checkpoint.save_every=3"]),
                            clock=lambda: now[0])
    # a validation loss after steps 2, 4 and the last, a save after steps 3 and the last
    assert pauses == ["valid", "save", "valid", "valid", "save"], pauses
    assert [m["step_time_s"] for m in history] == [1.0] * 5  # (steps 3, 4, 5: after a pause of 100 s)
