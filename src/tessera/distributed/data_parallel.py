"""Data parallelism over bucketed gradient buffers, with the reductions overlapped with backward.

Communication plan of one step (zero = ``parallel.zero``):

1. backward of every micro-batch: each parameter's gradient is added into its fp32 (or bf16)
   ``main_grad`` by a post-accumulate hook (``param.grad`` is dropped); the step's first one is
   copied in, so the buffer needs no zeroing pass (except under CUDA-graphed layers with fused
   weight gradients, whose replayed GEMMs always add: their buffers are zeroed at the step's
   start). Nothing is reduced while earlier micro-batches run.
2. zero 0/1: when every parameter of a bucket has received its last micro-batch's gradient, the
   bucket's reduction starts, asynchronously (``overlap_grad_reduce``), while backward goes on
   with earlier layers: an all-reduce (zero=0) or a reduce-scatter into this rank's shard
   (zero=1). zero=2 keeps no full gradient buffer: each bucket is reduce-scattered, and its
   buffer dropped, every time all its parameters have one more micro-batch's gradient; the
   shards accumulate in fp32.
3. without dp (dp=1, zero 0/1), a tied embedding's gradient (its own bucket,
   ``param.tied_across_stages``) is summed over the ``embedding`` group (first and last pipeline
   stage) here, started once it is final and the pipeline has issued its step's last send or
   receive (:meth:`pipeline_comm_done`: issued earlier on one rank than a pipeline message on
   another, it could deadlock NCCL), so on the first stage it overlaps the weight gradients that
   follow the embedding's. With dp, where it would wait for the dp reduction of the same bucket
   (the last to start on the first stage, so nothing left to overlap), and where the optimizer's
   gradient is a later fp32 copy (bf16 gradients at zero=0), ``finalize_model_grads`` does it
   after backward.
4. :meth:`finish_grad_sync` waits for them (and starts any that backward did not).
5. after the optimizer step (zero 1/2): every bucket's updated shards are all-gathered, in the
   order the next forward needs them, asynchronously (``overlap_param_gather``); a forward
   pre-hook on each layer waits for the buckets it reads.

The loss is already divided by the global token count, so every reduction is a sum.
Zero-bubble schedules compute some weight gradients outside autograd; a ``WeightGradStore``
whose sink is this object routes them through :meth:`accumulate` like the others. With
gradient-accumulation fusion a linear layer's weight gradient is never materialised:
:meth:`accumulate_product` has the GEMM add it into ``main_grad`` and counts the arrival as the
hook would; an untied embedding's lookup adds its rows through :meth:`accumulate_rows`.
"""

from __future__ import annotations

import collections
import contextlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor, nn

from tessera.distributed import collectives
from tessera.distributed.buffers import Bucket, OptimizerRange, ParamAndGradBuffer
from tessera.distributed.collectives import Pending
from tessera.tensor_parallel.wgrad import wgrad_into
from tessera.topology import Topology


@dataclass(eq=False)
class _BucketState:
    buffer: ParamAndGradBuffer
    bucket: Bucket
    range: OptimizerRange
    arrivals: collections.Counter = field(default_factory=collections.Counter)  # micro-batch round -> params
    rounds_reduced: int = 0  # zero=2
    ready: bool = False  # every parameter has its last micro-batch's gradient (zero 0/1)
    launched: bool = False  # the step's final reduction has started


def current_stream_id(device: torch.device) -> int:
    """The current CUDA stream of ``device`` as a number: torch's raw-stream query, which the
    gradient hook asks for every gradient of every micro-batch (torch.cuda.current_stream builds
    a Stream object each time), or the public call's handle where this torch lacks it."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    return raw(device.index if device.index is not None else torch.cuda.current_device()) if raw else \
        torch.cuda.current_stream(device).cuda_stream


class DataParallel:
    """Buckets, hooks and reductions for this rank's model chunks (zero 0, 1, 2)."""

    def __init__(self, chunks: list[nn.Module], topo: Topology, *, zero: int = 0,
                 param_dtype: torch.dtype = torch.float32, grad_dtype: torch.dtype = torch.float32,
                 bucket_size: int = 40_000_000, overlap_grad_reduce: bool = True,
                 overlap_param_gather: bool = True, embedding_group: dist.ProcessGroup | None = None):
        if zero not in (0, 1, 2):
            raise ValueError(f"DataParallel handles zero 0, 1, 2, not {zero} (zero=3 is FSDP)")
        # the ranks holding these parameters: dp, and cp (which splits the sequence, not the weights)
        self.group, self.dp_size, self.dp_rank = topo.group("dp_cp"), topo.dp_cp, topo.dp_cp_rank
        self.device, self._stream, self._stream_id, self._handover = torch.device(topo.device), None, 0, None
        self.zero, self.sharded = zero, zero >= 1
        self.overlap_grad_reduce, self.overlap_param_gather = overlap_grad_reduce, overlap_param_gather
        for chunk in chunks:
            for name, p in chunk.named_parameters():
                if hasattr(p, "main_grad"):
                    raise ValueError(f"parameter {name} is already managed by a DataParallel (it has a main_grad): "
                                     "call that one's remove() before wrapping the model again")
                if not p.requires_grad and p.is_floating_point() and p.dtype != param_dtype:
                    p.data = p.data.to(param_dtype)  # frozen: no buffer, but the model's one dtype
        self.buffers = [ParamAndGradBuffer([p for p in chunk.parameters() if p.requires_grad],
                                           param_dtype=param_dtype, grad_dtype=grad_dtype,
                                           bucket_size=bucket_size, dp=self.dp_size, device=topo.device,
                                           keep_grads=zero < 2)
                        for chunk in chunks]
        self._state: dict[nn.Parameter, _BucketState] = {}
        self._states: list[_BucketState] = []  # one per bucket, in backward order per chunk
        # (a chunk without trainable parameters has a buffer without buckets)
        self._states_of: dict[ParamAndGradBuffer, list[_BucketState]] = {b: [] for b in self.buffers}
        self.ranges: list[OptimizerRange] = []
        self._grad_hooks = []  # the post-accumulate hooks' handles (remove())
        for buffer in self.buffers:
            for bucket in buffer.buckets:
                st = _BucketState(buffer, bucket, self._optimizer_range(buffer, bucket))
                self._states.append(st)
                self._states_of[buffer].append(st)
                self.ranges.append(st.range)
                for p in bucket.params:
                    self._state[p] = st
                    self._grad_hooks.append(p.register_post_accumulate_grad_hook(self._on_grad))
        # Every bucket in the one order its reduction starts in when dp > 1: the chunks last to
        # first (the order their final backwards run in under the interleaved schedules, so
        # nothing waits that would not), each chunk's buckets in backward order. One order over
        # all chunks, not one per chunk: a parameter without a gradient on one dp rank holds its
        # bucket back on that rank only, and per-chunk orders would then pair different buckets
        # across the ranks (see _launch_ready).
        self._launch_order = [st for buffer in reversed(self.buffers) for st in self._states_of[buffer]]
        self._next_launch = 0  # this step: launch_order[:_next_launch] are launched
        self._count: dict[nn.Parameter, int] = dict.fromkeys(self._state, 0)
        self._expected = 0
        self._in_flight: collections.deque[Pending] = collections.deque()
        self._gathers: dict[Bucket, Pending] = {}
        # (module, its buckets, the hook's handle): the forward pre-hooks waiting for gathers
        self._gather_hooks: list[list] = []
        self.embedding_group = embedding_group
        self._tied_waiting: list[_BucketState] = []  # final, waiting for the pipeline's last message
        self._comm_done = False
        self.tied_reduced: set[nn.Parameter] = set()  # this step: summed over the embedding group here
        # weights whose fused gradient GEMM a CUDA graph replays (capture_fused): it always adds
        # into main_grad, so their buffers are zeroed at each step's start, and the graph's owner
        # reports their arrival (graphed_backward_done)
        self.graph_fused: set[nn.Parameter] = set()
        self._capturing = False
        if self.sharded and overlap_param_gather and self.group is not None:
            for chunk, buffer in zip(chunks, self.buffers):
                self._register_gather_hooks(chunk, buffer)

    # -- layout ---------------------------------------------------------------------------------
    def _optimizer_range(self, buffer: ParamAndGradBuffer, bucket: Bucket) -> OptimizerRange:
        if self.sharded:
            n = bucket.numel // self.dp_size
            lo = bucket.start + self.dp_rank * n
            hi = lo + n
        else:
            lo, hi = bucket.start, bucket.end
        if self.zero < 2 and buffer.grad_dtype == torch.float32:
            rng = OptimizerRange(buffer, bucket, lo, hi, buffer.grad_data[lo:hi], own_grad=False)  # in place
        else:  # an fp32 gradient of its own (counted by the memory report)
            grad = torch.zeros(hi - lo, dtype=torch.float32, device=buffer.device)
            rng = OptimizerRange(buffer, bucket, lo, hi, grad, own_grad=True, refresh=self.zero == 0)
        for p in bucket.params:
            plo, phi = buffer.param_range(p)
            a, b = max(plo, lo), min(phi, hi)
            if a < b:
                rng.fragments.append((p, a - lo, b - lo))
        return rng

    def model_state_bytes(self) -> tuple[int, int, int]:
        """(parameter bytes, gradient bytes incl. fp32 gradients of its own, parameter count)."""
        params = sum(b.param_data.numel() * b.param_data.element_size() for b in self.buffers)
        grads = sum(b.grad_data.numel() * b.grad_data.element_size() for b in self.buffers if b.grad_data is not None)
        grads += sum(rng.grad.numel() * 4 for rng in self.ranges if rng.own_grad)
        return params, grads, sum(p.numel() for p in self._state)

    # -- gradients --------------------------------------------------------------------------------
    def start_step(self, num_microbatches: int) -> None:
        """A new step: each parameter will receive ``num_microbatches`` gradients (the first is
        copied into the buffer, so nothing is zeroed here but zero=2's accumulating shards and
        the buffers of weights whose fused gradient GEMM a CUDA graph replays)."""
        self._expected = num_microbatches
        # a step that ended early (an exception between micro-batches) may have left reductions
        # in flight: wait for them now, so that none writes into this step's buffers or, under
        # zero=2, adds its shard on top of this step's when waited later
        while self._in_flight:
            self._in_flight.popleft().wait()
        # the stream the step's gradient work runs on (see _on_grad)
        if self.device.type == "cuda":
            self._stream, self._stream_id = torch.cuda.current_stream(self.device), current_stream_id(self.device)
            if self._handover is None:
                self._handover = torch.cuda.Event()
        for p in self._count:
            self._count[p] = 0
        for buffer in self.buffers:  # (zero 0/1: no memset; a step's first gradient is copied in)
            if buffer.grad_data is None:
                for bucket in buffer.buckets:
                    buffer.release_grad(bucket)
        if self.zero == 2:  # the fp32 shards accumulate every round's reduce-scatter
            for rng in self.ranges:
                rng.grad.zero_()
        if self.graph_fused:  # a replayed GEMM adds into main_grad even for a step's first micro-batch
            for buffer in {self._state[p].buffer for p in self.graph_fused}:
                buffer.grad_data.zero_()
        for st in self._states:
            st.arrivals.clear()
            st.rounds_reduced, st.ready, st.launched = 0, False, False
        self._next_launch = 0
        self._tied_waiting.clear()
        self.tied_reduced.clear()
        self._comm_done = False

    def _on_grad(self, p: nn.Parameter) -> None:
        grad, p.grad = p.grad, None
        if grad is None:  # a deferred weight gradient (zero-bubble I step); it comes later
            return
        if self._stream is None or current_stream_id(self.device) == self._stream_id:
            self.accumulate(p, grad)
            return
        # Autograd runs this hook on the stream its AccumulateGrad node was made on, after that
        # stream waited for the gradient's producer. A node made in a CUDA graph capture lives as
        # long as the graph, on the capture stream: the trainer captures on the step's own stream
        # (training/cuda_graphs.step_stream), so there this never runs. Graphs captured
        # elsewhere: a bucket's reduction waits for the stream it is launched from only, so every
        # add into the buffers runs on the step's stream, after the stream that holds this
        # gradient (one reused event).
        here = torch.cuda.current_stream(self.device)
        self._handover.record(here)
        self._stream.wait_event(self._handover)
        grad.record_stream(self._stream)
        torch.cuda.set_stream(self._stream)
        try:
            self.accumulate(p, grad)
        finally:
            torch.cuda.set_stream(here)

    def accumulate(self, p: nn.Parameter, grad: Tensor) -> None:
        """Add one micro-batch's gradient of ``p``; start reductions that became possible."""
        st = self._open(p)
        self._add(p, grad, st)
        self._arrived(p, st)

    def _add(self, p: nn.Parameter, grad: Tensor, st: _BucketState) -> None:
        main = p.main_grad
        if grad.shape != main.shape:  # (no view, a dispatcher call, for the usual same-shaped gradient)
            grad = grad.view(main.shape)
        if self._count[p] == 0 and st.buffer.grad_data is not None:
            main.copy_(grad)  # the buffer still holds last step's
        else:
            main.add_(grad)

    def accumulate_product(self, p: nn.Parameter, grad_out: Tensor, x: Tensor) -> None:
        """Gradient-accumulation fusion: add ``grad_out.T @ x`` (one micro-batch's gradient of
        the weight ``p``) into its main gradient inside the GEMM (``wgrad_into``)."""
        if self._capturing or p in self.graph_fused:  # what a graph replays: the GEMM only
            wgrad_into(p.main_grad, grad_out.t(), x, accumulate=True)
            if self._capturing:
                self.graph_fused.add(p)
            return
        st = self._open(p)
        first = self._count[p] == 0 and st.buffer.grad_data is not None
        wgrad_into(p.main_grad, grad_out.t(), x, accumulate=not first)
        self._arrived(p, st)

    def accumulate_rows(self, p: nn.Parameter, rows: Tensor, sums: Tensor) -> None:
        """Embedding gradient fusion: add one micro-batch's lookup gradient, ``sums`` [n, hidden]
        for the rows ``rows`` [n] of ``p`` (few repeats: ``lookup_row_sums``), into its main
        gradient, touching those rows only (a sorted, deterministic scatter-add) instead of a
        dense 16-bit gradient and an add."""
        st = self._open(p)
        main = p.main_grad.view(p.shape)
        if self._count[p] == 0 and st.buffer.grad_data is not None:
            main.zero_()  # the buffer still holds last step's
        main.index_put_((rows,), sums.to(main.dtype), accumulate=True)
        self._arrived(p, st)

    @contextlib.contextmanager
    def capture_fused(self):
        """While CUDA graphs capture layers (their warm-up runs included): a fused weight
        gradient only adds into ``main_grad`` (the GEMM the graph will replay) and its weight
        joins :attr:`graph_fused`; nothing is counted, and what the warm-up added is zeroed by
        the next :meth:`start_step`. Needs gradient buffers that stay in place (zero 0/1)."""
        if any(buffer.grad_data is None for buffer in self.buffers):
            raise ValueError("CUDA graphs with fused weight gradients need gradient buffers that stay in "
                             "place: zero 0 or 1, not zero=2 (its buffers live one bucket reduction)")
        self._capturing = True
        try:
            yield
        finally:
            self._capturing = False

    def graphed_backward_done(self, params: list[nn.Parameter]) -> None:
        """A graphed layer's backward replay has added one micro-batch's gradient of each of
        ``params`` (weights in :attr:`graph_fused`) into their main gradients: count them, and
        start the reductions that became possible, as :meth:`accumulate_product` does eagerly."""
        for p in params:
            self._arrived(p, self._open(p))

    def _open(self, p: nn.Parameter) -> _BucketState:
        st = self._state[p]
        if st.launched:
            raise RuntimeError(f"a gradient of a {tuple(p.shape)} parameter arrived after its bucket was "
                               f"reduced ({self._expected} micro-batches expected, it has {self._count[p] + 1}): "
                               "a parameter used twice per micro-batch outside one autograd graph?")
        if p.main_grad is None:
            st.buffer.allocate_grad(st.bucket)
        return st

    def _arrived(self, p: nn.Parameter, st: _BucketState) -> None:
        self._count[p] += 1
        st.arrivals[self._count[p]] += 1
        complete = len(st.bucket.params)
        if self.zero == 2:
            while st.arrivals[st.rounds_reduced + 1] == complete:
                st.rounds_reduced += 1
                if st.rounds_reduced == self._expected:
                    st.launched = True
                self._reduce_round(st)
        elif self.overlap_grad_reduce and st.arrivals[self._expected] == complete:
            st.ready = True
            self._launch_ready(st.buffer)

    def _launch_ready(self, buffer: ParamAndGradBuffer) -> None:
        """Start the ready buckets. With dp, strictly in :attr:`_launch_order`, never one before an
        earlier one: every dp rank then issues the same collectives in the same order even where
        a bucket completes at different times on different ranks (a parameter without a
        gradient on one rank: its bucket starts only in :meth:`finish_grad_sync` there), torch
        DDP's rule, kept across model chunks. Without dp there is no order to keep: each ready
        bucket of ``buffer`` starts (a tied embedding's sum over the embedding group, the first
        stage's last bucket, need not wait for the weight gradients after it)."""
        if self.group is None:
            for st in self._states_of[buffer]:
                if st.ready and not st.launched:
                    self._launch(st)
            return
        order = self._launch_order
        while self._next_launch < len(order) and order[self._next_launch].ready:
            self._launch(order[self._next_launch])
            self._next_launch += 1

    def _launch(self, st: _BucketState) -> None:
        st.launched = True
        flat, rng = st.bucket.grad, st.range
        pending = None
        if self.group is None:
            if rng.own_grad and not rng.refresh:
                rng.grad.copy_(flat)
        else:
            if self.zero == 0:
                pending = collectives.all_reduce(flat, self.group, async_op=self.overlap_grad_reduce)
            else:
                pending = collectives.reduce_scatter(flat, rng.grad, self.group, accumulate=False,
                                                     async_op=self.overlap_grad_reduce)
        if pending is not None:
            self._in_flight.append(pending)
        elif self._sums_tied(st):
            self._tied_waiting.append(st)
            if self._comm_done:
                self.pipeline_comm_done()

    def _sums_tied(self, st: _BucketState) -> bool:
        """Whether this bucket is a tied embedding summed over the embedding group here: no dp
        (its gradient is final now) and the optimizer's gradient is the buffer's own (not an
        fp32 copy made later). Both ends of the group have the same config, so agree."""
        return (self.group is None and self.embedding_group is not None and not st.range.refresh
                and getattr(st.bucket.params[0], "tied_across_stages", False))

    def pipeline_comm_done(self) -> None:
        """The pipeline has issued this step's last send or receive on this rank: start the tied
        embedding's sum over the embedding group for every tied bucket already final."""
        self._comm_done = True
        while self._tied_waiting:
            st = self._tied_waiting.pop(0)
            self._in_flight.append(collectives.all_reduce(st.range.grad, self.embedding_group, async_op=True))
            self.tied_reduced.update(st.bucket.params)

    def _reduce_round(self, st: _BucketState) -> None:
        """zero=2: reduce-scatter what the bucket holds into the fp32 shard, drop the buffer."""
        flat = st.bucket.grad
        st.buffer.release_grad(st.bucket)
        if self.group is None:
            st.range.grad.add_(flat)
            return
        pending = collectives.reduce_scatter(flat, st.range.grad, self.group, accumulate=True,
                                             async_op=self.overlap_grad_reduce)
        pending.keep = flat  # alive until the collective is done
        self._in_flight.append(pending)
        while len(self._in_flight) > 2:  # bound the gradient memory in flight
            self._in_flight.popleft().wait()

    def finish_grad_sync(self) -> None:
        """Start what backward did not (in the launch order), then wait for every reduction of
        this step."""
        for st in self._launch_order:
            if self.zero < 2:
                if not st.launched:
                    for p in st.bucket.params:
                        if self._count[p] == 0:  # no gradient this step: clear last step's
                            p.main_grad.zero_()
                    self._launch(st)
            else:
                if st.rounds_reduced < self._expected and self.group is not None:
                    # Another rank may have completed that round: the reduce-scatters would pair up
                    # differently across ranks. Refuse rather than risk summing the wrong buckets.
                    missing = [tuple(p.shape) for p in st.bucket.params if self._count[p] < self._expected]
                    raise RuntimeError(f"zero=2 needs every parameter to get a gradient in every micro-batch; "
                                       f"parameters of shapes {missing} got fewer than {self._expected}: "
                                       "use parallel.zero=1 (or 0, 3) for this model")
                if st.bucket.grad is not None:  # gradients not yet reduced (a round never completed)
                    self._reduce_round(st)
                st.launched = True
        self.pipeline_comm_done()
        while self._in_flight:
            self._in_flight.popleft().wait()

    # -- parameters -------------------------------------------------------------------------------
    def forward_order(self) -> list[int]:
        """Indices into ``ranges`` (one per bucket) in the order the next forward reads the
        buckets: chunk by chunk, each chunk's buckets back to front (they are laid out in
        backward order)."""
        order, first = [], 0
        for buffer in self.buffers:
            order += range(first + len(buffer.buckets) - 1, first - 1, -1)
            first += len(buffer.buckets)
        return order

    def start_param_gather(self) -> None:
        """zero 1/2, after the optimizer updated this rank's shards: all-gather every bucket, in
        :meth:`forward_order`."""
        if not self.sharded or self.group is None:
            return
        for i in self.forward_order():
            bucket = self.ranges[i].bucket
            pending = collectives.all_gather(bucket.param, self.group, async_op=self.overlap_param_gather)
            if self.overlap_param_gather:
                self._gathers[bucket] = pending

    def wait_param_gather(self, buckets=None) -> None:
        for bucket in list(self._gathers) if buckets is None else buckets:
            pending = self._gathers.pop(bucket, None)
            if pending is not None:
                pending.wait()

    def _register_gather_hooks(self, chunk: nn.Module, buffer: ParamAndGradBuffer) -> None:
        """Who waits for which bucket. Each layer waits for the buckets holding its parameters;
        the chunk itself, before anything runs, for those of the parameters registered before its
        layers (embeddings, which the model may read directly); every later module with
        parameters of its own (final norm, head) for those."""
        layers = getattr(chunk, "layers", [])
        layers = list(layers.values()) if isinstance(layers, nn.ModuleDict) else list(layers)
        in_layers = {p for layer in layers for p in layer.parameters()}
        for layer in layers:
            self._hook(layer, set(layer.parameters()))
        before = set()
        for p in chunk.parameters():
            if p in in_layers:
                break
            before.add(p)
        self._hook(chunk, before)
        for module in chunk.modules():
            own = {p for p in module.parameters(recurse=False) if p not in in_layers and p not in before}
            self._hook(module, own)

    def _hook(self, module: nn.Module, params: set[nn.Parameter]) -> None:
        # waited for in the order their gathers start (a module's buckets: one chunk's, laid out
        # back to front)
        buckets = sorted({self._state[p].bucket for p in params if p in self._state}, key=lambda b: -b.index)
        if buckets:
            self._gather_hooks.append([module, buckets, self._register_wait(module, buckets)])

    def remove(self) -> None:
        """Detach from the model: its gradient hooks and gather waits removed, its parameters'
        ``main_grad`` dropped (they stay views of this object's parameter buffers), so that the
        model can be wrapped again (with a new ``WeightGradStore`` where the layers hold one).
        Waits for whatever is still in flight first."""
        while self._in_flight:
            self._in_flight.popleft().wait()
        self.wait_param_gather()
        for handle in self._grad_hooks:
            handle.remove()
        for entry in self._gather_hooks:
            entry[2].remove()
        self._grad_hooks, self._gather_hooks = [], []
        for p in self._state:
            if hasattr(p, "main_grad"):  # (a second remove() finds none)
                del p.main_grad

    def _register_wait(self, module: nn.Module, buckets: list[Bucket]):
        return module.register_forward_pre_hook(lambda *_: self.wait_param_gather(buckets))

    @contextlib.contextmanager
    def gather_hooks_lifted(self, modules: list[nn.Module]):
        """``modules`` without their gather-waiting forward pre-hooks, which are registered again
        on leaving (the same waits, run before each call). For CUDA graph capture:
        ``make_graphed_callables`` refuses modules with hooks, while a hook registered after it
        runs before every replay: the wait for a layer's gathered parameters then makes the
        replay's stream wait for the gather (outside the graph), as it does for an eager forward."""
        lifted = [entry for entry in self._gather_hooks if any(entry[0] is m for m in modules)]
        for entry in lifted:
            entry[2].remove()
        try:
            yield
        finally:
            for entry in lifted:
                entry[2] = self._register_wait(entry[0], entry[1])
