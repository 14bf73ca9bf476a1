"""One optimizer step over a global batch.

Communication plan of a step:

1. one all-reduce of the number of loss tokens over dp (so every micro-batch's loss is divided
   by the *global* count: the mean over all tokens of the global batch, however they are
   spread over micro-batches and ranks);
2. the pipeline executor runs this rank's schedule: forward/backward per micro-batch and chunk,
   activations and gradients between stages (TP collectives happen inside the layers);
   gradients accumulate in the data-parallel buffers, whose buckets start their dp reductions
   during the last micro-batch's backward (tessera.distributed.data_parallel; FSDP for zero=3);
3. wait for those reductions; finalize: sequence-parallel partial gradients summed over tp,
   tied-embedding copies summed over the embedding group;
4. fp16: unscale and check for inf/nan on every rank (skip the step if any);
5. the global gradient norm (one all-reduce over tp x pp, and over dp when gradients are
   sharded), the AdamW step on the fp32 main parameters with the clipping factor applied to
   the gradients (inside the fused kernel on CUDA), skipped on the device where that norm is
   not finite (bf16/fp32 with a guard: training/rerun.py) (then, zero >= 1, the
   parameter all-gather, overlapped with the next step's forward);
6. the reported loss: one all-reduce over dp (meaningful on the last pipeline stage), before the
   optimizer step. It and the token count of 1 go over ``dp_scalars``, a second communicator
   over the dp ranks: NCCL runs one communicator's work in order, and on ``dp`` they would
   wait for the parameter all-gather of 5, and the next forward with them.

The step never waits for the GPU (except fp16's inf/nan check, and at pp > 1 the run's first
message from each pipeline peer, whose shape header the host reads; the trainer's P2P keeps
those shapes for later steps): the loss, gradient norm and
token count are copied to pinned host memory behind the step's work, with an event, and a
``StepResult`` reads them when first asked for, waiting for that event only. The trainer reads
step k after it has launched step k+1, so the GPU goes from one step to the next without
waiting for the host.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from tessera.distributed.finalize import finalize_model_grads
from tessera.optim import DynamicLossScaler, clip_coefficient
from tessera.optim.clip import grad_norm_and_nonfinite
from tessera.pipeline_parallel.executor import PipelineExecutor
from tessera.training.rerun import NumericsGuard
from tessera.training.timers import PhaseTimer
from tessera.topology import Topology

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class StepResult:
    """A step's reported loss (mean over the global batch's tokens), global gradient norm and
    token count. On CUDA they are on their way to the host when the step returns (one copy,
    into pinned memory, queued right after the step's work, with an event): reading them waits
    for this step's work only, not for whatever was launched after it. The first two
    launches (step k+1 is launched before step k is read) each allocate a pinned block, which
    synchronises the device; later ones reuse the blocks that earlier, read results freed
    (torch's caching host allocator)."""

    values: Tensor  # [loss, grad norm, tokens(, skipped)], float64, on the host (pinned on CUDA)
    ready: torch.cuda.Event | None = None  # CUDA: recorded behind the step's work (timing on)
    host_skipped: bool = False  # fp16: the loss scaler's verdict (else the device's flag, in values)
    finished_at: float = 0.0  # off CUDA: the host clock when the (synchronous) step returned
    _read: list[float] | None = field(default=None, init=False, repr=False)

    @staticmethod
    def launch(loss: Tensor, grad_norm: Tensor, tokens: Tensor, skipped: bool | Tensor,
               clock=time.perf_counter) -> "StepResult":
        """``skipped``: the host's answer, or the device's flag (training/rerun.py), read with the
        rest. ``clock``: the host clock ``finished_at`` is read from (off CUDA)."""
        values = [loss.detach().double(), grad_norm.detach().double(), tokens.double()]
        if torch.is_tensor(skipped):
            values.append(skipped.double())
        values = torch.stack(values)
        skipped = skipped if isinstance(skipped, bool) else False
        if values.device.type != "cuda":
            return StepResult(values, None, skipped, clock())
        host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
        host.copy_(values, non_blocking=True)
        ready = torch.cuda.Event(enable_timing=True)
        ready.record()
        return StepResult(host, ready, skipped)

    def _values(self) -> list[float]:
        if self._read is None:
            if self.ready is not None:
                self.ready.synchronize()
            self._read = self.values.tolist()
        return self._read

    @property
    def loss(self) -> float:
        return self._values()[0]

    @property
    def grad_norm(self) -> float:
        return self._values()[1]

    @property
    def tokens(self) -> int:
        return int(self._values()[2])

    @property
    def skipped(self) -> bool:
        """Whether the step left the weights as they were (fp16 overflow, non-finite gradients)."""
        return self.host_skipped or (len(self.values) > 3 and self._values()[3] != 0)


class StepClock:
    """Time per step where the step's work runs: between CUDA events on a GPU (the host runs a
    step ahead, so its clock would time the launches), on the host clock elsewhere (``clock``,
    the one ``StepResult.finished_at`` is read from; tests give a stand-in)."""

    def __init__(self, device: torch.device, clock=time.perf_counter) -> None:
        self._clock = clock
        self.last_time, self.last_event = clock(), None
        self._restart: tuple | None = None  # (the step launched before a pause, the pause's end: event, time)
        self._lapped: StepResult | None = None  # the step timed last
        if device.type == "cuda":
            self.last_event = torch.cuda.Event(enable_timing=True)
            self.last_event.record()

    def lap(self, result: StepResult) -> float:
        """Seconds from the previous step's end (or the clock's start, or the end of work between
        steps: :meth:`restart`) to ``result``'s."""
        if result.ready is not None and self.last_event is not None:
            result.ready.synchronize()
            elapsed, self.last_event = self.last_event.elapsed_time(result.ready) / 1e3, result.ready
        else:
            elapsed, self.last_time = result.finished_at - self.last_time, result.finished_at
        self._lapped = result
        if self._restart is not None and self._restart[0] is result:  # the next step starts after the pause
            _, event, now = self._restart
            self.last_event, self.last_time, self._restart = event or self.last_event, now, None
        return elapsed

    def restart(self, after: StepResult) -> None:
        """Work between steps just ended (a validation loss, a checkpoint's save) after step
        ``after`` was launched: the next step is timed from now, not from ``after``'s end, so its
        tokens/s and MFU are the step's own (at once where ``after`` was timed already)."""
        event = None
        if self.last_event is not None:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
        if after is self._lapped:
            self.last_event, self.last_time, self._restart = event or self.last_event, self._clock(), None
        else:
            self._restart = (after, event, self._clock())


def _sum_over(x: torch.Tensor, group) -> torch.Tensor:
    if group is not None:
        dist.all_reduce(x, group=group)
    return x


def train_step(optimizer, micro_batches: list[dict], topo: Topology, executor: PipelineExecutor,
               data_parallel, *, clip_grad: float, scaler: DynamicLossScaler | None = None,
               guard: NumericsGuard | None = None, timer: PhaseTimer | None = None) -> StepResult:
    """``micro_batches``: this dp rank's share. ``optimizer``: a MainParamOptimizer or
    FSDPOptimizer over the chunks the executor runs; ``data_parallel`` their DataParallel or
    FullyShardedDataParallel. ``guard``: skips a step whose gradient norm is not finite, on the
    device (training/rerun.py); without one, such a step is applied as it is. ``timer``: the
    phases' spans (training/timers.py)."""
    if timer is None:
        timer = _UNTIMED
    device = topo.device
    # (pipeline middle stages hold no loss mask: their count is unused, the loss is on the last stage)
    local_tokens = sum((mb["loss_mask"].sum() for mb in micro_batches if "loss_mask" in mb),
                       torch.zeros((), device=device)).to(torch.float32)  # on the device: no host wait
    # the step's scalars travel on their own dp communicator (Topology): on "dp" they would wait
    # for the previous step's overlapped parameter all-gather, and the forward with them
    scalars = topo.group("dp_scalars") or topo.group("dp_cp")
    with timer.span("dp_wait"):
        global_tokens = _sum_over(local_tokens.clone(), scalars)
    data_parallel.start_step(len(micro_batches))
    # (a global batch without a token the loss counts, e.g. all end-of-document under
    # data.eod_mask_loss, gives loss 0 and zero gradients, not 0/0)
    with timer.span("forward_backward"):
        loss_sum = executor.run(micro_batches, global_tokens.clamp(min=1),
                                loss_scale=scaler.scale if scaler is not None else 1.0,
                                after_comm=getattr(data_parallel, "pipeline_comm_done", None),
                                timer=timer if timer is not _UNTIMED else None)
    with timer.span("dp_wait"):
        data_parallel.finish_grad_sync()
    with timer.span("optimizer"):
        loss, grad_norm, skipped = _finish_step(optimizer, topo, data_parallel, loss_sum, scalars, clip_grad, scaler,
                                                guard)
    return StepResult.launch(loss, grad_norm, global_tokens, skipped=skipped, clock=timer.clock)


def _finish_step(optimizer, topo, data_parallel, loss_sum, scalars, clip_grad, scaler, guard):
    """Steps 3-6 of the plan after the reductions: finalize, the norm, the optimizer step, the
    loss; (loss, gradient norm, skipped: the host's answer or the device's flag)."""
    device = topo.device
    grads = optimizer.grads()
    finalize_model_grads(grads, topo, done=getattr(data_parallel, "tied_reduced", ()))
    if guard is not None:
        guard.poison([g for g, _ in grads])
    finite = True
    if scaler is not None:
        finite = scaler.unscale_and_check([g for g, _ in grads], None, device)
        scaler.update(finite)
    guarded = guard is not None and scaler is None
    grad_norm, bad = grad_norm_and_nonfinite(grads, topo, optimizer.sharded, count_nonfinite=guarded) if finite \
        else (torch.tensor(float("nan"), device=device), None)
    if guarded:
        # the loss's all-reduce over dp (before the step starts zero 1/2's parameter all-gather)
        # also sums the non-finite gradients: every rank knows of one anywhere, also where the
        # norm leaves it out (zero=0's dp replicas, copies it does not count); the norm is then nan
        loss, bad = _sum_over(torch.stack([loss_sum, bad.to(loss_sum.dtype)]), scalars).unbind()
        grad_norm = torch.where(bad > 0, torch.full_like(grad_norm, float("nan")), grad_norm)
    else:
        loss = _sum_over(loss_sum, scalars)  # before the step starts zero 1/2's parameter all-gather
    skip = guard.skip(grad_norm) if guarded else None
    if finite:
        optimizer.step(clip_coefficient(grad_norm, clip_grad), skip=skip)
    optimizer.zero_grad()
    return loss, grad_norm, not finite if skip is None else skip


class _Untimed:
    """No timer: spans that record nothing, the host clock."""

    clock = staticmethod(time.perf_counter)

    @contextlib.contextmanager
    def span(self, name):
        yield


_UNTIMED = _Untimed()
