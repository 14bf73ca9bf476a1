"""One executor for every schedule: walk this rank's action list, do each action.

State per (micro-batch, chunk) lives from its forward to its backward: the stage's input (a leaf
that collects the input gradient) and its output (or, on the last stage, the loss). Receives are
posted when the list says (one compute early, so they overlap with the current compute) and
waited for only by the compute that consumes them. A forward output, once sent, keeps only its
autograd graph: its storage is released as soon as the send completes (backward needs the graph
and the incoming gradient, not the output's values), as Megatron's deallocate_output_tensor.

What this executor does that torch.distributed.pipelining's cannot: it drives tessera's
Megatron-style TP/SP layers and RNG streams directly, splits backward into I and W through the
layers' own weight-gradient store (no graph surgery), and runs the same action lists that the
simulator times and draws.
"""

from __future__ import annotations

import contextlib
import time

import torch
from torch import Tensor
from torch.autograd import Variable

from tessera.models import GPTModel
from tessera.pipeline_parallel.p2p import P2P, PendingRecv
from tessera.pipeline_parallel.schedules import COMPUTE, Action, Op
from tessera.tensor_parallel.wgrad import WeightGradStore


def run_backward(output: Tensor, grad: Tensor | None) -> None:
    """Backward from ``output`` whose values may have been released (so no shape check);
    ``grad=None`` for the scalar loss."""
    if grad is None:
        grad = torch.ones_like(output)
    Variable._execution_engine.run_backward(
        tensors=(output,), grad_tensors=(grad,), keep_graph=False, create_graph=False, inputs=(),
        allow_unreachable=True, accumulate_grad=True)


def _release(t: Tensor) -> None:
    t.data = torch.empty((1,), device=t.device, dtype=t.dtype)


class PipelineExecutor:
    def __init__(self, chunks: list[GPTModel], actions: list[Action], p2p: P2P | None, pp: int, pp_rank: int,
                 wgrad_store: WeightGradStore | None = None):
        self.chunks, self.actions, self.p2p = chunks, actions, p2p
        # the micro-batches this rank's schedule runs (run() refuses another count)
        self.num_microbatches = 1 + max((a.microbatch for a in actions if a.op in COMPUTE), default=-1)
        self.pp, self.pp_rank, self.wgrad_store = pp, pp_rank, wgrad_store
        if wgrad_store is None and any(a.op in (Op.I, Op.W) for a in actions):
            raise ValueError("this schedule splits backward into I and W (zero-bubble): its deferred weight "
                             "gradients need a WeightGradStore (wgrad_store=), the one the model's layers hold")
        self.vpp = len(chunks)
        self.peak_in_flight = 0  # most micro-batches holding activations at once (F done, B or I not; last run)
        self.peak_weight_grads_pending = 0  # most deferred W's at once (I done, W not; last run)
        self.peak_held = 0  # most micro-batches holding anything at once (F done, B or W not; last run)
        # a list to fill (CUDA): per compute action, (op, micro-batch, chunk, host perf_counter at
        # its launch, CUDA events at its start and end on the compute stream), for timelines
        self.trace: list[tuple] | None = None

    def _stage(self, chunk: int) -> int:
        return chunk * self.pp + self.pp_rank

    def _tag(self, microbatch: int, chunk: int) -> int:
        return microbatch * self.vpp + chunk

    @staticmethod
    def _received(pending: PendingRecv, timer) -> Tensor:
        with timer.span("pipeline_wait") if timer is not None else contextlib.nullcontext():
            return pending.wait()

    def run(self, micro_batches: list[dict[str, Tensor]], global_tokens: Tensor, loss_scale: float = 1.0,
            after_comm=None, timer=None) -> Tensor:
        """Forward and backward of every micro-batch; returns the summed loss (on the last stage;
        zero elsewhere). Gradients accumulate in ``param.grad`` (or, under DataParallel, in its buffers).
        ``after_comm``: called once this rank has issued its step's last send or receive (at once
        without any), so that collectives on other groups can start without ever being issued
        before a pipeline message on one rank and after it on another (which can deadlock NCCL).
        ``timer``: an object whose ``span("pipeline_wait")`` times each wait for a received tensor
        (training/timers.py)."""
        if len(micro_batches) != self.num_microbatches:
            raise ValueError(f"this rank's schedule runs {self.num_microbatches} micro-batches, got {len(micro_batches)}: "
                             "build the schedule for the step's micro-batch count")
        device = global_tokens.device
        last = self.pp * self.vpp - 1
        loss_sum = torch.zeros((), device=device)
        recvs: dict[tuple, PendingRecv] = {}
        state: dict[tuple[int, int], tuple[Tensor | None, Tensor]] = {}  # F done, backward not yet
        input_grads: dict[tuple[int, int], Tensor] = {}  # backward done, SEND_B not yet
        holding: set[tuple[int, int]] = set()  # activations alive: F done, B or I not yet
        deferred: set[tuple[int, int]] = set()  # I done, W not yet: the weight-gradient store holds its inputs
        if self.wgrad_store is not None:  # (what a failed step deferred is not this step's)
            self.wgrad_store.clear()
        if self.p2p is not None:
            self.p2p.new_step()
        self.peak_in_flight = self.peak_weight_grads_pending = self.peak_held = 0
        last_comm = max((i for i, a in enumerate(self.actions) if a.op not in COMPUTE), default=-1)
        if after_comm is not None and last_comm < 0:
            after_comm()
        i = -1
        try:
            for i, action in enumerate(self.actions):
                mb, c, op = action.microbatch, action.chunk, action.op
                key = (mb, c)
                if self.trace is not None and op in COMPUTE:
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    self.trace.append((op.name, mb, c, time.perf_counter(), start, end))
                    start.record()
                if op in (Op.RECV_F, Op.RECV_B):
                    # tagged with the sender's chunk: the neighbouring virtual stage, which may wrap
                    sender = self._stage(c) + (-1 if op == Op.RECV_F else 1)
                    recvs[(op, key)] = self.p2p.recv(op.value[-1], action.peer, self._tag(mb, sender // self.pp))
                elif op == Op.F:
                    stage, batch = self._stage(c), micro_batches[mb]
                    x = self._received(recvs.pop((Op.RECV_F, key)), timer).requires_grad_() if stage > 0 else None
                    out = self.chunks[c](tokens=batch["tokens"] if stage == 0 else None, hidden=x,
                                         labels=batch["labels"] if stage == last else None,
                                         position_ids=batch.get("position_ids"), document_ids=batch.get("document_ids"))
                    if stage == last:
                        out = (out * batch["loss_mask"]).sum() / global_tokens
                        loss_sum += out.detach()
                        out = out * loss_scale if loss_scale != 1.0 else out
                    state[key] = (x, out)
                    holding.add(key)
                    self.peak_in_flight = max(self.peak_in_flight, len(holding))
                    self.peak_held = max(self.peak_held, len(holding) + len(deferred))
                elif op == Op.SEND_F:
                    out = state[key][1]
                    self.p2p.send("F", action.peer, self._tag(mb, c), out.detach())
                    _release(out)
                elif op in (Op.B, Op.I):
                    x, out = state.pop(key)
                    grad = None if self._stage(c) == last else self._received(recvs.pop((Op.RECV_B, key)), timer)
                    with self.wgrad_store.defer(key) if op == Op.I else contextlib.nullcontext():
                        run_backward(out, grad)
                    if x is not None:
                        input_grads[key] = x.grad
                    holding.discard(key)
                    if op == Op.I:
                        deferred.add(key)
                        self.peak_weight_grads_pending = max(self.peak_weight_grads_pending, len(deferred))
                elif op == Op.SEND_B:
                    self.p2p.send("B", action.peer, self._tag(mb, c), input_grads.pop(key))
                elif op == Op.W:
                    self.wgrad_store.run(key)
                    deferred.discard(key)
                if self.trace is not None and op in COMPUTE:
                    self.trace[-1][-1].record()
                if i == last_comm and after_comm is not None:
                    after_comm()
                if self.p2p is not None:
                    self.p2p.reap()
            if self.p2p is not None:
                self.p2p.wait_sends()
        except BaseException as error:
            # Messages of this step still posted or due (a receive not taken, a send or receive
            # the schedule had still to issue) would pair with the next step's: the channel is
            # unusable from here, and says so rather than mixing steps or hanging.
            if self.p2p is not None and (i <= last_comm or recvs):
                self.p2p.fail(f"{type(error).__name__} at action {i} of pipeline rank {self.pp_rank}'s step")
            raise
        assert not state and not recvs and not input_grads, "the schedule left work undone"
        return loss_sum
