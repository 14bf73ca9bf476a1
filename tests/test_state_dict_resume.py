"""Resuming from the pieces' state dicts (docs/architecture.md: "a run resumed from state dicts
continues exactly").

Every resume run mirrors the trainer's loop (training/trainer.py): the parts ``build`` assembles
(DataParallel + MainParamOptimizer, or FSDP + FSDPOptimizer), DataFeed
(synthetic data), LRScheduler (warmup + cosine, a weight-decay ramp) and, for fp16, a
DynamicLossScaler, then ``train_step``. Each run trains STEPS steps straight; at step SAVE it
saves every state dict (model, optimizer, scheduler, data feed, loss scaler; through torch.save
and torch.load in memory) and goes on. Then a fresh stack is built (new objects, the model initialised from another seed,
the global RNG reseeded, a fresh data feed at sample 0 and a fresh scaler at its initial scale),
the state dicts are loaded, and the steps after SAVE are trained: losses, gradient norms,
skipped steps and final parameters must equal the uninterrupted run's to the bit (the same
arithmetic in the same order). Dropout runs also carry the RNG tracker's streams, which no
piece's state dict holds.

The step number is not in any state dict (LRScheduler's holds its settings only): the resumed
loop starts at SAVE, which a checkpoint would have to store (or recount from the data feed's
consumed samples, as ``steps_done`` does).

One ``run_ranks`` call per world size (each worker loops over its runs), as
test_features_on_layouts does.
"""

from __future__ import annotations

import io
import time
import traceback

import pytest
import torch
from torch.distributed.tensor import DTensor

from tessera.config import load_config
from tessera.optim import DynamicLossScaler, LRScheduler, MicroBatchCalculator
from tessera.tensor_parallel import RNGTracker
from tessera.testing import run_ranks
from tessera.topology import Topology
from tessera.training.data_feed import DataFeed
from tessera.training.step import train_step
from tessera.training.build import build, build_chunks
from tessera.training.plan import make_plan
from tessera.training.preflight import validate
from training_runs import shared_result

STEPS, SAVE = 5, 3
SEQ, VOCAB = 16, 64
OTHER_SEED = 4321  # the resumed stack's initial weights and RNG: a piece not restored shows
BASE = ["model.hidden=32", "model.layers=2", "model.heads=2", f"model.seq_len={SEQ}", f"model.vocab_size={VOCAB}",
        "train.micro_batch=1", "train.global_batch=8", f"train.steps={STEPS}", "train.seed=7",
        "data.source=synthetic", "optim.lr=1e-2", "optim.clip_grad=0.5", "optim.eps=1e-6",
        "parallel.bucket_size=3000",
        # the rate and decay change every step: a resumed step number or schedule that is off shows
        "optim.warmup=2", "optim.decay_style=cosine", "optim.min_lr=1e-3",
        "optim.weight_decay_incr_style=linear", "optim.start_weight_decay=0.0", "optim.end_weight_decay=0.2"]
# global batch 2, 2, 4, 6, then 8 samples (one increment per 4 samples): the save after step 3
# (8 samples consumed) is mid-ramp, the next batch 6
RAMP = ["train.batch_rampup=2,2,12"]
BF16, FP16 = ["train.dtype=bf16"], ["train.dtype=fp16", "model.tie_embeddings=false"]
# fp16: the scaler's state must have moved before the save: 2^20 overflows at the first step
# (skipped, halved to 2^19), steps 2 and 3 are clean, so the save holds 2^19 and 2 clean steps of
# 3 (a fresh scaler: 2^20 and 0); the resumed step 4 doubles the scale only if it counts on from 2
SCALER = dict(init_scale=2.0**20, growth_interval=3)


def steps_done(cfg, consumed: int) -> int:
    """The optimizer steps that consumed ``consumed`` samples (the batch calculator replayed)."""
    calc, n = MicroBatchCalculator.from_config(cfg.train, cfg.parallel.dp), 0
    while calc.consumed_samples < consumed:
        calc.advance()
        n += 1
    assert calc.consumed_samples == consumed, (calc.consumed_samples, consumed)
    return n


class Stack:
    """What the trainer builds for one rank, and its loop's step."""

    def __init__(self, topo: Topology, overrides: list[str], init_seed: int | None = None):
        self.cfg = cfg = validate(load_config(None, BASE + overrides), topo.world_size)
        self.topo = topo
        seed = cfg.train.seed if init_seed is None else init_seed
        self.rng = RNGTracker.for_rank(seed, topo.tp_rank, topo.pp_rank)
        plan = make_plan(cfg, topo.device)
        chunks = build_chunks(cfg, topo, plan, self.rng)
        if init_seed is not None:  # other initial weights than the saved run's (before the buffers copy them)
            for chunk in chunks:
                chunk.init_weights(init_seed)
        self.stage = build(cfg, topo, plan, chunks=chunks)
        self.data_parallel, self.optimizer = self.stage.data_parallel, self.stage.optimizer
        self.scheduler = LRScheduler(cfg.optim, cfg.train.steps)
        self.scaler = DynamicLossScaler(**SCALER) if cfg.train.dtype == "fp16" else None
        self.feed = DataFeed(cfg, topo)

    def step(self, step: int) -> dict:
        self.scheduler.apply(self.optimizer, step)
        micro_batches = self.feed.next()
        r = train_step(self.optimizer, micro_batches, self.topo, self.stage.executor(len(micro_batches)),
                       self.data_parallel, clip_grad=self.cfg.optim.clip_grad, scaler=self.scaler)
        return {"loss": r.loss, "norm": r.grad_norm, "skipped": r.skipped}

    def state_dicts(self) -> dict:
        """Through torch.save and torch.load(weights_only=True), as a checkpoint file would hold
        them (the model's and optimizer's state dicts reference live tensors; FSDP's are DTensors)."""
        self.data_parallel.wait_param_gather()  # (zero 1/2: the model's copy complete)
        states = {"model": self.stage.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                  "scheduler": self.scheduler.state_dict(), "data": self.feed.state_dict()}
        if self.scaler is not None:
            states["scaler"] = self.scaler.state_dict()
        if self.cfg.model.dropout:  # the dropout streams: in none of the pieces' state dicts
            states["rng"] = self.rng.get_states()
        blob = io.BytesIO()
        torch.save(states, blob)
        blob.seek(0)
        return torch.load(blob, weights_only=True)

    def load(self, states: dict, optimizer_first: bool = False) -> None:
        if optimizer_first:
            if self.topo.dp_rank == 1:
                time.sleep(0.5)  # ranks reach the load at different moments (makes the outcome deterministic)
            self.optimizer.load_state_dict(states["optimizer"])
            self.stage.model.load_state_dict(states["model"])
        else:
            self.stage.model.load_state_dict(states["model"])
            self.optimizer.load_state_dict(states["optimizer"])
        self.scheduler.load_state_dict(states["scheduler"])
        self.feed.load_state_dict(states["data"])
        if self.scaler is not None:
            self.scaler.load_state_dict(states["scaler"])
        if "rng" in states:
            self.rng.set_states(states["rng"])

    def ends(self) -> dict:
        """The loss scale and data position at the end: the scale changes no fp32 result while
        it stays a power of two without overflow, so it is compared itself."""
        return {"data": self.feed.state_dict(), "scaler": self.scaler.state_dict() if self.scaler else None}

    def params(self) -> dict[str, torch.Tensor]:
        self.data_parallel.wait_param_gather()
        return {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
                for name, p in self.stage.model.named_parameters()}


def resume_run(topo: Topology, overrides: list[str], optimizer_first: bool = False) -> dict:
    straight = Stack(topo, overrides)
    before, states, saved_scale = [], None, None
    for step in range(STEPS):
        if step == SAVE:
            states = straight.state_dicts()
        before.append(straight.step(step))
    final, end = straight.params(), straight.ends()
    del straight

    torch.manual_seed(OTHER_SEED)
    resumed = Stack(topo, overrides, init_seed=OTHER_SEED)
    fresh = resumed.params()
    differs = any(not torch.equal(fresh[n], final[n]) for n in final)
    first = steps_done(resumed.cfg, states["data"]["consumed_samples"])
    if resumed.scaler is not None:
        saved_scale = (states["scaler"], resumed.scaler.state_dict())
    resumed.load(states, optimizer_first)
    after = [resumed.step(step) for step in range(first, STEPS)]
    params = resumed.params()
    return {"straight": before, "resumed": after, "first": first, "fresh_differs": differs,
            "ends": (end, resumed.ends()),
            "scales": saved_scale, "schedule": resumed.stage.plan.schedule, "pp_rank": topo.pp_rank,
            "params_equal": {n: torch.equal(params[n], final[n]) for n in final},
            "max_diff": max((params[n].float() - final[n].float()).abs().max().item() for n in final)}


def _resume_worker(rank: int, world: int, runs: list[tuple[str, int, list[str], bool]]) -> dict:
    out = {}
    for name, pp, overrides, optimizer_first in runs:
        topo = Topology.build(pp=pp)
        try:  # a run that raises on every rank alike (a refused state) fails its own test only
            out[name] = resume_run(topo, [f"parallel.pp={pp}", *overrides], optimizer_first)
        except Exception:
            out[name] = {"error": traceback.format_exc()}
    return out


def run(name, pp=1, overrides=(), optimizer_first=False):
    return (name, pp, list(overrides), optimizer_first)


ZERO = [f"parallel.zero={z}" for z in range(4)]
RUNS = {
    1: [run("fp32"), run("bf16", overrides=BF16), run("fp16", overrides=FP16), run("ramp", overrides=RAMP)],
    2: [run(f"dp2-zero{z}", overrides=[ZERO[z]]) for z in range(3)]
       + [run(f"dp2-zero{z}-bf16", overrides=[ZERO[z], *BF16]) for z in range(3)]
       + [run("dp2-zero3", overrides=[ZERO[3]]), run("dp2-zero3-bf16", overrides=[ZERO[3], *BF16]),
          run("dp2-zero1-fp16", overrides=[ZERO[1], *FP16]),
          run("dp2-zero1-ramp", overrides=[ZERO[1], *RAMP]),
          run("dp2-zero3-ramp", overrides=[ZERO[3], *RAMP]),
          # torch's order is free: the optimizer's state loaded before the model's
          run("dp2-zero1-optimizer-first", overrides=[ZERO[1]], optimizer_first=True),
          run("dp2-zero1-bf16-optimizer-first", overrides=[ZERO[1], *BF16], optimizer_first=True),
          run("pp2", pp=2), run("pp2-bf16", pp=2, overrides=BF16), run("pp2-fp16", pp=2, overrides=FP16),
          run("pp2-ramp", pp=2, overrides=RAMP),
          # dropout: exact only with the RNG tracker's streams saved too (get_states / set_states)
          run("dp2-zero1-dropout", overrides=[ZERO[1], "model.dropout=0.2"])],
}
NAMES = {name: world for world, runs in RUNS.items() for name, *_ in runs}
_RESULTS: dict[int, list[dict] | BaseException] = {}


def results(world: int) -> list[dict]:
    """One run per world size, shared by its tests; a failure is remembered (one deadline, not one per test)."""
    return shared_result(_RESULTS, world, lambda: run_ranks(_resume_worker, world, RUNS[world], timeout=150)
                         if world > 1 else [_resume_worker(0, 1, RUNS[1])])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", [pytest.param(name, marks=pytest.mark.slow) if world > 1 else name
                                  for name, world in NAMES.items()])  # (dp=2, pp=2: one run of ~15 s)
def test_resumed_run_continues_exactly(name):
    """Save at step 3 of 5, load into a fresh stack (other initial weights), train steps 4-5:
    the same losses, gradient norms, skipped steps and parameters as the run that went on.
    Guards: the model's and optimizer's state dicts (incl. the fp32 main parameters of a
    16-bit model at zero 0-2, FSDP's DTensor shards and their AdamW state at zero=3), the
    scheduler's (the rate and decay of steps 4-5), the data feed's position (mid-ramp for the
    ramp runs: the next batch is 6 samples), the loss scaler's scale and clean-step count
    (fp16), at one process, dp=2 (zero 0-3) and pp=2 (ZB-H1, a tied embedding)."""
    for rank, out in enumerate(results(NAMES[name])):
        r = out[name]
        where = f"{name} rank {rank}"
        assert "error" not in r, f"{where}: {r.get('error')}"
        assert r["fresh_differs"], f"{where}: the fresh stack starts from the saved run's weights"
        assert r["first"] == SAVE, where
        assert r["resumed"] == r["straight"][SAVE:], where
        assert r["ends"][1] == r["ends"][0], where
        assert r["params_equal"] == dict.fromkeys(r["params_equal"], True), (where, r["max_diff"])
        if r["pp_rank"] == 1 or "pp2" not in name:
            assert all(s["loss"] > 0 for s in r["straight"]), where  # (the loss is on the last stage)
        if "fp16" in name:  # the scale had moved before the save, so a fresh scaler is visibly off
            saved, fresh = r["scales"]
            assert saved == {"scale": 2.0**19, "clean_steps": 2} and fresh == {"scale": 2.0**20, "clean_steps": 0}, where
            assert [s["skipped"] for s in r["straight"]] == [True] + [False] * (STEPS - 1), where
            assert r["ends"][0]["scaler"] == {"scale": 2.0**20, "clean_steps": 4}, where
        if "pp2" in name:
            assert r["schedule"] == "zb-h1", where


def test_ramp_is_mid_ramp_at_the_save():
    cfg = validate(load_config(None, BASE + RAMP), 1)
    calc = MicroBatchCalculator.from_config(cfg.train, 1)
    batches = [calc.advance() for _ in range(STEPS)]
    assert batches == [2, 2, 4, 6, 8] and sum(batches[:SAVE]) == 8
