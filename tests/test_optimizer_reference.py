"""tessera's optimizer step against torch.optim.AdamW on a plain copy of the model.

The parity tests compare every layout with tessera's own one-process run, so a mistake that
every layout shares (betas swapped where they are handed to AdamW, weight decay on the wrong
parameters, the LR schedule not reaching a group) passes them all. Here the reference is
written from the rules alone: AdamW with ``optim.beta1/beta2/eps``, the step's learning rate
and weight decay from ``LRScheduler``, weight decay on matrices only (biases and norms none),
over the gradient of the mean loss over the global batch's tokens, on a deep copy of the model
taken before data parallelism wraps it.

The whole training path runs (``build`` + ``train_step``, as the trainer reaches the optimizer)
for several steps, each on another batch, at dp=1 and at dp=2 with zero 0, 1, 2 (DataParallel
with MainParamOptimizer) and 3 (FSDP with FSDPOptimizer). Each dp rank holds one micro-batch
(dp=1: both, in order), so the reduced gradient is the same sum of the same fp32 terms as the
reference's, and the reference's AdamW runs the same foreach kernels tessera's does on a CPU:
losses and weights must be equal bit for bit. The betas are not the defaults and not close to
each other, so swapping them, or using the defaults, changes every weight.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.distributed.tensor import DTensor

from training_runs import shared_result
from tessera.config import load_config
from tessera.optim import LRScheduler
from tessera.tensor_parallel import RNGTracker
from tessera.testing import run_ranks
from tessera.topology import Topology
from tessera.training.build import build, build_chunks
from tessera.training.plan import make_plan
from tessera.training.step import train_step

SEQ, VOCAB, GLOBAL, STEPS = 8, 48, 4, 5
BETAS = (0.8, 0.97)
BASE = ["model.family=gpt2", "model.hidden=16", "model.layers=2", "model.heads=2", f"model.seq_len={SEQ}",
        f"model.vocab_size={VOCAB}", "model.vocab_pad_multiple=16", "train.micro_batch=2",
        f"train.global_batch={GLOBAL}", f"train.steps={STEPS}", "train.seed=11", "parallel.bucket_size=1500",
        # warmup then cosine decay: another learning rate at every step; weight decay rising linearly
        "optim.lr=2e-2", "optim.min_lr=2e-3", "optim.warmup=2", "optim.decay_style=cosine",
        "optim.weight_decay_incr_style=linear", "optim.start_weight_decay=0.05", "optim.end_weight_decay=0.3",
        f"optim.beta1={BETAS[0]}", f"optim.beta2={BETAS[1]}", "optim.eps=1e-6", "optim.clip_grad=0"]

_results: dict = {}


def _batch(step: int) -> dict[str, torch.Tensor]:
    """Another global batch every step, with a different number of loss tokens per row."""
    g = torch.Generator().manual_seed(500 + step)
    rows = torch.randint(0, VOCAB, (GLOBAL, SEQ + 1), generator=g)
    mask = (torch.rand(GLOBAL, SEQ, generator=g) > 0.3).float()
    mask[:, 0] = 1.0
    return {"tokens": rows[:, :-1], "labels": rows[:, 1:], "loss_mask": mask}


def _micro_batches(batch: dict, dp: int, micro: int) -> list[list[dict]]:
    """Each dp rank's contiguous share of ``batch``, cut into micro-batches."""
    share = GLOBAL // dp
    return [[{k: v[r * share + i: r * share + i + micro] for k, v in batch.items()} for i in range(0, share, micro)]
            for r in range(dp)]


class Reference:
    """The model's plain copy and torch's AdamW over it, set up from the rules, not from tessera's
    optimizer: matrices decay, vectors do not; lr and weight decay from the schedule each step."""

    def __init__(self, model: torch.nn.Module, cfg):
        self.model, self.cfg = model, cfg
        params = [p for p in model.parameters() if p.requires_grad]
        self.decay = [p for p in params if p.ndim >= 2]
        self.plain = [p for p in params if p.ndim < 2]
        assert self.decay and self.plain, "the model must have matrices and vectors"
        o = cfg.optim
        # foreach: the kernels tessera's AdamW runs on a CPU (torch's default there is its per-tensor loop)
        self.adamw = torch.optim.AdamW([{"params": self.decay}, {"params": self.plain, "weight_decay": 0.0}],
                                       lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, foreach=True)
        self.schedule = LRScheduler(o, cfg.train.steps)

    def step(self, step: int, shares: list[list[dict]], clip_grad: float = 0.0) -> tuple[float, float]:
        """One step over every dp rank's micro-batches; returns the loss and the gradient norm.
        Each rank's gradient is accumulated over its micro-batches in order, then the ranks'
        gradients are summed."""
        tokens = sum(mb["loss_mask"].sum() for share in shares for mb in share)
        loss, total = torch.zeros(()), None  # summed in fp32, as the step sums it
        for share in shares:
            self.adamw.zero_grad(set_to_none=True)
            for mb in share:
                out = self.model(tokens=mb["tokens"], labels=mb["labels"])
                mb_loss = (out * mb["loss_mask"]).sum() / tokens
                mb_loss.backward()
                loss += mb_loss.detach()
            grads = [p.grad.clone() for p in self.model.parameters()]
            total = grads if total is None else [t + g for t, g in zip(total, grads)]
        for p, g in zip(self.model.parameters(), total):
            p.grad = g
        norm = torch.nn.utils.get_total_norm(total)
        if clip_grad:
            torch.nn.utils.clip_grad_norm_(list(self.model.parameters()), clip_grad)
        for group, decays in zip(self.adamw.param_groups, (True, False)):
            group["lr"] = self.schedule.lr(step)
            group["weight_decay"] = self.schedule.weight_decay(step) if decays else 0.0
        self.adamw.step()
        return loss.item(), norm.item()


def train_against_reference(topo: Topology, overrides: list[str]) -> dict:
    """``STEPS`` steps of tessera (build + train_step, the schedule applied as the trainer does)
    and of the reference, on the same batches; both runs' losses and final weights."""
    cfg = load_config(None, BASE + [f"parallel.dp={topo.dp}", *overrides])
    plan = make_plan(cfg, topo.device)
    chunks = build_chunks(cfg, topo, plan, RNGTracker.for_rank(cfg.train.seed, topo.tp_rank, topo.pp_rank))
    ref = Reference(copy.deepcopy(chunks[0]), cfg)  # before data parallelism takes the parameters over
    parts = build(cfg, topo, plan, chunks=chunks)
    schedule = LRScheduler(cfg.optim, cfg.train.steps)
    losses, norms, ref_losses, ref_norms, lrs = [], [], [], [], []
    for step in range(STEPS):
        shares = _micro_batches(_batch(step), topo.dp, cfg.train.micro_batch)
        mine = shares[topo.dp_rank]
        lrs.append(schedule.apply(parts.optimizer, step))
        result = train_step(parts.optimizer, mine, topo, parts.executor(len(mine)), parts.data_parallel,
                            clip_grad=cfg.optim.clip_grad)
        losses.append(result.loss)
        norms.append(result.grad_norm)
        ref_loss, ref_norm = ref.step(step, shares, cfg.optim.clip_grad)
        ref_losses.append(ref_loss)
        ref_norms.append(ref_norm)
    parts.data_parallel.wait_param_gather()
    params = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
              for n, p in parts.chunks[0].named_parameters()}
    return dict(losses=losses, norms=norms, ref_losses=ref_losses, ref_norms=ref_norms, lrs=lrs, params=params,
                ref_params={n: p.detach().clone() for n, p in ref.model.named_parameters()})


def _assert_equal_to_reference(out: dict, what: str) -> None:
    # (warmup's last rate is the peak, where the decay starts: one rate repeats)
    assert len({round(lr, 9) for lr in out["lrs"]}) == STEPS - 1, f"the rate should change: {out['lrs']}"
    assert out["losses"] == out["ref_losses"], f"{what}: losses {out['losses']} vs reference {out['ref_losses']}"
    # the global norm sums its squares in another order than torch's (and over dp shards): ulps apart
    torch.testing.assert_close(out["norms"], out["ref_norms"], rtol=1e-6, atol=0,
                               msg=lambda m: f"{what}: gradient norms: {m}")
    assert out["params"].keys() == out["ref_params"].keys()
    for name, ref in out["ref_params"].items():
        mine = out["params"][name]
        assert torch.equal(mine, ref), (f"{what}: {name} differs from torch's AdamW by up to "
                                        f"{(mine - ref).abs().max().item():.3g}")


def _one_process(overrides: list[str]) -> dict:
    return train_against_reference(Topology.build(), overrides)


def test_adamw_step_equals_torch_adamw_on_one_process():
    """dp=1 (two micro-batches accumulated), zero=0: bit for bit with torch's AdamW."""
    out = _one_process([])
    _assert_equal_to_reference(out, "dp=1")


def test_adamw_with_clipping_equals_torch_adamw_and_clip_grad_norm():
    """Clipping that binds at every step (clip_grad below every step's norm) against
    torch.nn.utils.clip_grad_norm_. The two norms are summed in other orders (tessera: squares
    of per-tensor norms, torch: the norm of the per-tensor norms), so the factors may differ in
    the last bit; AdamW is nearly invariant to that scale: the weights agree within 1e-7."""
    out = _one_process(["optim.clip_grad=0.05"])
    assert min(out["norms"]) > 0.05 * 1.5, f"clipping should bind at every step: norms {out['norms']}"
    assert out["losses"][0] == out["ref_losses"][0]  # (the first loss is before any step)
    torch.testing.assert_close(out["losses"], out["ref_losses"], rtol=1e-6, atol=0)
    torch.testing.assert_close(out["norms"], out["ref_norms"], rtol=1e-6, atol=0)
    for name, ref in out["ref_params"].items():
        torch.testing.assert_close(out["params"][name], ref, rtol=1e-6, atol=1e-7,
                                   msg=lambda m: f"clipped run, {name}: {m}")


def _dp_worker(rank: int, world: int) -> dict:
    topo = Topology.build()
    return {zero: train_against_reference(topo, [f"parallel.zero={zero}"]) for zero in range(4)}


def _dp_results() -> list[dict]:
    return shared_result(_results, "dp2", lambda: run_ranks(_dp_worker, 2, timeout=120))


@pytest.mark.timeout(150)
@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_adamw_step_equals_torch_adamw_over_data_parallel(zero):
    """dp=2, one micro-batch per rank: zero 0 (replicated), 1 and 2 (each rank updates its shard,
    then the shards are gathered), 3 (FSDP): every rank's whole model equals torch's AdamW on
    the whole global batch, bit for bit."""
    for rank, out in enumerate(_dp_results()):
        _assert_equal_to_reference(out[zero], f"dp=2 zero={zero}, rank {rank}")
