"""Micro-batch pairs on two streams (``parallel.tp_microbatch_pairs``): at tp > 1 the step runs
its micro-batches two at a time, the second of each pair on a side CUDA stream with a TP
communicator of its own, so one micro-batch's sequence-parallel collectives run while the
other's GEMMs do. Inside a layer the collectives and the GEMMs that need their result run back
to back on one stream (a CUDA-graphed layer too), so at tp=2 the GPU spends part of each layer
waiting for NVLink; two whole micro-batches (their GEMMs keep their size, unlike halves of one)
on two streams measured 0.832 of their time one after the other (8 GPT-1.3B layers,
``benchmarks/tp_two_stream_probe.py``, BENCHMARKS.md session 16). DeepSpeed's Domino splits a
batch the same way for the same reason.

How a pair runs (``PairedExecutor``): the side stream waits for the current one, then the two
forwards are issued a piece each in turn (the embedding, each layer, the output layer and loss:
GPTModel's ``in_steps``), the first's on the current stream, the second's on the side stream
with every TP collective on the second communicator (``TPGroupSwap``). Issued one whole forward
after the other, the GPU got the second only as the first ended (the host issues each piece as
the GPU frees room for it), and the two backwards likewise: session 18's profile of GPT-1.3B at
tp=2 + SP showed each pair's four passes one after the other, 37 of 103 ms of NCCL a step beside
compute. Then the two backwards run at once: the second from a worker thread, on the side
stream, while this thread runs the first (autograd runs each backward op on its forward's
stream). Autograd's one thread per CUDA device takes both backwards' nodes from one queue, most
recently created first: with the forwards alternating piece by piece, the two backwards
alternate layer by layer, and every data-parallel hook still runs on that one thread, one
gradient at a time. Each micro-batch's gradients arrive in data parallelism on their own (the
same per-micro-batch fp32 adds as without pairs), on the step's stream: the second forward
reuses the first's live AccumulateGrad nodes (graphed, the nodes the first set's capture made on
the step's stream, cuda_graphs.step_stream), and autograd makes their stream wait for the side
stream's gradient, so the current stream runs a layer behind the side stream. The current stream
waits for the side stream at the end of each pair. An odd last micro-batch runs alone. Where zero
1/2's parameter gather overlaps the step's first forward (its waits are forward hooks, run on
the stream that runs the piece), the side stream waits for the current one after each of the
first pair's first-forward pieces instead, running a piece behind. zero=2 runs the two backwards
one after the other: its reduction rounds count one micro-batch's gradients at a time.

Why two backward calls, not one over both losses: one call sums a parameter's two gradients
(in bf16) before its accumulate hook, where pairs keep each micro-batch's fp32 add. (The first
version, one call with the forwards one after the other, measured +1.0 % at GPT-1.3B tp=2 + SP,
session 16.)

Two communicators, because NCCL runs one communicator's operations in order: on one, the second
micro-batch's collectives would queue behind the first's. CUDA-graphed layers are captured once
per communicator (``graph_pairs``): each micro-batch of a pair replays its own graphs, with their
own static buffers, captured on their own stream (so with their own cuBLAS workspace).

Measured with graphed layers at tp=2 + SP (session 18): GPT-1.3B +13.7 % over the run without
pairs (47,399 against 41,692 tokens/s, 2x H200; 0.789 of one GPU), Llama-1B +8.3 % (50,864
against 46,951, 2x H100; 0.814); the version that issued whole forwards and backwards one after
the other gained +3.3-5.7 % (session 17). What is left in the profile: the step's stream carries
both micro-batches' fp32 gradient adds (~30 ms of a 345 ms step), so it ends each pair's backward
~13 ms after the side stream; and the two forwards, issued in step, run their collectives at the
same moments (each layer's all-gathers side by side, then its GEMMs), so the forwards hide
little. The second backward's adds on the side stream (``side_adds``, distributed/side_adds.py)
measured +2.0-2.5 % (353-355 against 361-363 ms a step in five A/Bs, benchmarks/pairs_ab.py,
2x H100, session 19) and pass their GPU test, but stay off while the pairs may hang (below);
starting the side stream's forward 60-120 µs late (a spin kernel) to put the forwards'
collectives apart changed nothing (341 ms) and was dropped.

Experimental, opt-in (parallel.tp_microbatch_pairs=true; auto runs none, trainer.microbatch_pairs):
in session 19, 4 of 19 GPT-1.3B tp=2 + SP runs of benchmarks/pairs_ab.py hung within their
first 10 steps (at least one with side adds off; two with the serial first step below), both
ranks' hosts blocked in a graph replay of a layer of a pair's first forward where a stack dump
was taken: the GPUs had stopped. The pairs keep two NCCL
communicators' collectives in flight at once, which NCCL's documentation says may deadlock
(an NCCL kernel spinning for its peer can keep the other communicator's kernel from starting,
in a different order on each GPU). Waiting for the GPU after each piece of the first step's
pairs (so that the communicators' first uses ran alone) did not help: 2 of 9 runs hung, at
steps 2 and 5. What might: kernels started in the order they were issued
(CUDA_DEVICE_MAX_CONNECTIONS=1, Megatron's way of keeping its overlapped collectives in issue
order; the forwards are issued by one thread in the same order on every rank, the backwards by
two threads), or collectives that need no spinning kernel (copy-engine transfers over symmetric
memory); neither measured yet.

In session 20 one hardware queue (CUDA_DEVICE_MAX_CONNECTIONS=1) stopped the hang (0 of 6
runs) but also the gain (+3 % over no pairs, against +13 %). A suspect: the order the two
backwards issue their graphs in. Autograd's device thread takes the nodes of both graph tasks
from one queue, but the second task starts when its host thread gets there, so how far the
first has gone by then, and with it the order of the two communicators' collectives, may differ
from rank to rank. ``backward_in_turn`` (experimental, off; ``parallel.tp_pairs_backward=in_turn``,
benchmarks/pairs_ab.py's setting "turn") takes the threads out: each forward is cut into its pieces (GPTModel's ``cut``: the
residual stream between pieces, and a tied output layer's weight, read through leaves of their
own), and this thread issues the backwards a piece at a time, the losses' first, then each
layer's from the last, the two micro-batches in turn: the same order on every rank, and still
each micro-batch's own gradients in data parallelism, in the same order as one micro-batch after
the other (the tests compare it to the bit). Measured on the GPU: not yet.

What it needs (config.validate refuses the rest): pp=1, tp > 1, layers not compiled whole (the
compiled collectives take the group by name), no fused weight gradients (two streams would add
into one main gradient at once) and not FSDP (zero=3's hooks gather and free per forward).
On a CPU it runs the same steps with the backwards one after the other (no streams); the tests
check it there against the run without pairs, to the bit.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from concurrent.futures import ThreadPoolExecutor, wait

import torch
from torch import Tensor, nn

from tessera.distributed.side_adds import MarkStart, SideAdds, used_more_than_once
from tessera.pipeline_parallel.executor import run_backward
from tessera.tensor_parallel.mappings import Group
from tessera.training.cuda_graphs import capturing_on, release_all


class TPGroupSwap:
    """A reusable context: while inside, every TP group reference of ``modules`` (a submodule's
    attribute that is ``old``, and the ``group`` of a TPContext a submodule holds) is ``new``;
    put back on exit, also after an error. The references are found once, here (the walk over
    every module's attributes would cost host time per micro-batch); a module's are swapped in its
    instance dictionary, where they were found: nn.Module's ``__setattr__`` costs ~2 µs a call,
    ~0.35 ms per entry and exit for GPT-1.3B's 98 references, and a pair enters once per layer.
    Autograd functions keep the group they were given in forward, so the backward of what ran
    inside uses ``new`` too."""

    def __init__(self, modules: list[nn.Module], old: Group, new: Group) -> None:
        if old is None or new is None:  # None is "no TP": it would match every unset attribute
            raise ValueError(f"TPGroupSwap swaps a TP group for another, not {old!r} for {new!r}")
        self.old, self.new = old, new
        self.references: list[tuple[dict, str]] = []  # (a module's __dict__, the attribute's name)
        self.contexts: list[object] = []  # TPContexts (slotted dataclasses: a plain setattr)
        seen: set[int] = set()
        for module in modules:
            for sub in module.modules():
                for name, value in vars(sub).items():
                    if value is old:
                        self.references.append((vars(sub), name))
                    elif (dataclasses.is_dataclass(value) and not isinstance(value, type) and id(value) not in seen
                          and getattr(value, "group", None) is old):
                        seen.add(id(value))
                        self.contexts.append(value)

    def __enter__(self) -> "TPGroupSwap":
        self._set(self.new)
        return self

    def __exit__(self, *exc) -> None:
        self._set(self.old)

    def _set(self, group: Group) -> None:
        for attributes, name in self.references:
            attributes[name] = group
        for context in self.contexts:
            context.group = group


class PairedExecutor:
    """Runs a pp=1 step's micro-batches in pairs, the second of each on ``side`` (a CUDA stream;
    None on a CPU) with its TP collectives on ``second_group``. ``gathers_in_forward``: zero 1/2's
    parameter gather waits in the step's first forward (the first pair's second micro-batch then
    follows the first one piece behind). ``concurrent_backward``: the two backwards run at once
    (the second from a worker thread; only with ``side``, and not under zero=2, whose reduction
    rounds assume one micro-batch's gradients at a time). The PipelineExecutor's ``run``
    interface, for the trainer's step."""

    def __init__(self, model: nn.Module, first_group: Group, second_group: Group,
                 side: torch.cuda.Stream | None, gathers_in_forward: bool = False,
                 concurrent_backward: bool = True):
        self.model, self.side, self.gathers_in_forward = model, side, gathers_in_forward
        self.concurrent_backward = concurrent_backward and side is not None
        self._overlap_backwards = concurrent_backward  # (not under zero=2; on a CPU too, for the in-turn order)
        self.second = TPGroupSwap([model], first_group, second_group)
        self._worker: ThreadPoolExecutor | None = None
        # the DataParallel (zero 0/1) whose buffers the gradients go to (trainer.build_data_parallel
        # sets it): with ``side_adds``, the second backward adds its gradients on the side stream
        # (distributed/side_adds.py; +2.0-2.5 % at GPT-1.3B tp=2 + SP; its GPU test passes since
        # session 19, but it stays off while the pairs themselves may hang: see above)
        self.data_parallel = None
        self.side_adds = False
        self._shared: set[nn.Parameter] | None = None  # parameters a micro-batch's graph uses twice or more
        self._in_turn = False

    @property
    def backward_in_turn(self) -> bool:
        """The two backwards issued by this thread, piece by piece in turn (_backwards_in_turn),
        instead of from two threads: experimental (see the module's docstring). Refused where
        the backwards run one after the other anyway (zero=2)."""
        return self._in_turn

    @backward_in_turn.setter
    def backward_in_turn(self, on: bool) -> None:
        if on and not self._overlap_backwards:
            raise ValueError("backward_in_turn interleaves a pair's two backwards, which this executor runs one "
                             "after the other (concurrent_backward=False: zero=2's reduction rounds take one "
                             "micro-batch's gradients at a time)")
        self._in_turn = bool(on)

    def _steps(self, batch: dict[str, Tensor], global_tokens: Tensor, cut=None):
        """One micro-batch's forward a piece per ``next`` (GPTModel's ``in_steps``, cut where
        ``cut`` is given): None after each piece but the last, then its loss (summed over the
        batch's tokens / global_tokens)."""
        steps = self.model(tokens=batch["tokens"], labels=batch["labels"], position_ids=batch.get("position_ids"),
                           document_ids=batch.get("document_ids"), in_steps=True, cut=cut)
        for out in steps:
            yield None if out is None else (out * batch["loss_mask"]).sum() / global_tokens

    def _on_side(self):
        return torch.cuda.stream(self.side) if self.side is not None else contextlib.nullcontext()

    @staticmethod
    def _current():
        return torch.cuda.current_stream()

    def run(self, micro_batches: list[dict[str, Tensor]], global_tokens: Tensor, loss_scale: float = 1.0,
            after_comm=None) -> Tensor:
        """Forward and backward of every micro-batch; returns the summed loss. ``after_comm``
        (a pipeline's last message sent) is called at once: pp=1 sends none."""
        if after_comm is not None:
            after_comm()
        current = self._current() if self.side is not None else None
        losses = []  # each micro-batch's, summed in their order at the end (as the pipeline executor sums)
        for i in range(0, len(micro_batches), 2):
            pair = micro_batches[i:i + 2]
            if len(pair) == 1:  # an odd last micro-batch, alone on the current stream
                *_, loss = self._steps(pair[0], global_tokens)
                losses.append(loss.detach())
                run_backward(loss * loss_scale if loss_scale != 1.0 else loss, None)
                continue
            cuts = (_Cuts(), _Cuts()) if self._in_turn else (None, None)
            try:
                first, second = self._forwards(pair, global_tokens, current,
                                               after_gathers=i == 0 and self.gathers_in_forward, cuts=cuts)
                losses += [first.detach(), second.detach()]
                if loss_scale != 1.0:
                    first = first * loss_scale
                    with self._on_side():
                        second = second * loss_scale
                if self._in_turn:
                    self._backwards_in_turn(first, second, *cuts)
                else:
                    self._backwards(first, second)
            finally:  # the pair's side work done before what follows, also after an error
                if self.side is not None:
                    current.wait_stream(self.side)
        loss_sum = torch.zeros((), device=global_tokens.device)
        for loss in losses:  # (the side stream's are done: the current stream waited for it)
            loss_sum += loss
        return loss_sum

    def _forwards(self, pair: list[dict[str, Tensor]], global_tokens: Tensor, current, after_gathers: bool,
                  cuts=(None, None)):
        """The pair's forwards, issued a piece each in turn (embedding, each layer, output), the
        second's on the side stream over the second communicator, so that the GPU has both at
        once (issued one whole forward after the other, the second started only as the first
        ended: session 18's profile). The side stream first waits for the current one; where the
        first forward waits for zero 1/2's gathered parameters, after each of its pieces instead.
        Returns the two losses."""
        if self.side is not None and not after_gathers:
            self.side.wait_stream(current)
        first = self._steps(pair[0], global_tokens, cuts[0])
        with self._on_side(), self.second:
            second = self._steps(pair[1], global_tokens, cuts[1])  # (runs, pre-hooks too, at its first next())
        for first_loss in first:
            if self.side is not None and after_gathers:
                self.side.wait_stream(current)
            with self._on_side(), self.second:
                second_loss = next(second)
        return first_loss, second_loss

    def _backwards(self, first: Tensor, second: Tensor) -> None:
        """The first loss's backward, and the second's on the side stream (autograd runs each
        backward op on its forward's stream). Concurrent: the second from a worker thread while
        this thread runs the first; autograd's one CUDA thread then takes the two graphs' nodes in
        turn (by creation order, which the interleaved forwards alternate), so both streams have
        work; every gradient still arrives on its own in data parallelism, on that one thread (no
        two hooks at once). Otherwise (CPU, zero=2) the first then the second."""
        if not self.concurrent_backward:
            run_backward(first, None)
            self._second_backward(second)
            return
        if self._worker is None:  # (on the side stream's device: a thread starts on device 0, and
            # leaving torch.cuda.stream there would make a CUDA context on GPU 0 for every rank)
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tessera-second-backward",
                                              initializer=self._worker_device)
        data_parallel = self.data_parallel if self.side_adds else None
        try:
            if data_parallel is not None:  # the second's gradients added on the side stream (distributed/side_adds.py)
                if self._shared is None:  # (the graph's shape is the same every pair)
                    self._shared = used_more_than_once(second)
                data_parallel.side_adds = SideAdds(self._current(), self.side, step_only=self._shared)
                with self._on_side():
                    second = MarkStart.apply(second, data_parallel.side_adds)
            with _mismatch_warning_off():
                pending = self._worker.submit(self._on_side_backward, second)
                try:
                    run_backward(first, None)
                except BaseException:
                    wait([pending])  # (the first error is the one to see)
                    raise
                pending.result()
        finally:
            if data_parallel is not None:
                data_parallel.side_adds = None

    def _backwards_in_turn(self, first: Tensor, second: Tensor, first_cuts: "_Cuts", second_cuts: "_Cuts") -> None:
        """The two backwards issued by this thread alone, a piece at a time, the two micro-batches
        in turn: the losses' pieces (output layer and loss), then each layer's from the last, the
        first micro-batch's on the current stream, the second's on the side stream. Every rank
        then issues the two communicators' collectives in one fixed order (from two threads, the
        order depends on when the second thread starts). Each piece's backward is seeded with the
        gradient the later piece left on the leaf it read (``_Cuts``); a tied output layer's
        weight gradient joins the embedding piece's backward, so that autograd sums the two
        before the accumulate hook, as in one backward. Every gradient still arrives on its own in
        data parallelism, in the same order as one micro-batch after the other."""
        with _expected_stream_mismatch():
            run_backward(first, None)
            with self._on_side():
                run_backward(second, None)
            for k in reversed(range(len(first_cuts.hidden))):
                for cuts, on_side in ((first_cuts, False), (second_cuts, True)):
                    roots = [cuts.root(k)]
                    if k == 0 and cuts.tied is not None:
                        roots.append(cuts.tied_root())
                    roots = [r for r in roots if r[1] is not None]
                    with self._on_side() if on_side else contextlib.nullcontext():
                        if roots:
                            run_backward_roots(roots)
                    cuts.hidden[k] = None  # (its activations' graph freed)

    def _worker_device(self) -> None:
        if isinstance(self.side, torch.cuda.Stream):
            torch.cuda.set_device(self.side.device)

    def _second_backward(self, second: Tensor) -> None:
        with _expected_stream_mismatch():
            self._on_side_backward(second)

    def _on_side_backward(self, second: Tensor) -> None:
        # its seed made, and its backward called, in its forward's stream
        with self._on_side():
            run_backward(second, None)


@contextlib.contextmanager
def _mismatch_warning_off():
    """Inside, torch does not check AccumulateGrad nodes' streams (its own switch, put back
    after): while the two backwards run at once, the second's gradients come from the side
    stream into the nodes on the step's stream, by design (see _expected_stream_mismatch).
    Python's warning filters cannot hide one thread's warnings only (catch_warnings is global
    state; from the worker thread it hid the first backward's warnings at times). The first
    backward's gradients and nodes are both on the step's stream, so it has nothing to warn of.
    The switch's getter is private: where it is missing, the switch is put back on."""
    switch = getattr(torch.autograd.graph, "set_warn_on_accumulate_grad_stream_mismatch", None)
    if switch is None:  # a torch without the check
        yield
        return
    before = getattr(torch._C, "_warn_on_accumulate_grad_stream_mismatch", lambda: True)()
    switch(False)
    try:
        yield
    finally:
        switch(before)


@contextlib.contextmanager
def _expected_stream_mismatch():
    """Inside, torch's warning that an AccumulateGrad node's stream differs from its gradient's
    producer's is not shown: the second micro-batch's gradients come from the side stream into
    the nodes the first forward made on the step's stream, and the wait it warns of is the one
    wanted (DataParallel adds on the step's stream). Other warnings pass."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The AccumulateGrad node's stream does not match")
        yield


def graph_pairs(chunks: list[nn.Module], capture, first_group: Group, second_group: Group) -> list:
    """CUDA-graphed layers for micro-batch pairs: ``capture()`` (the trainer's ``graph_stage``,
    returning a list of LayerGraphs) runs once with the first communicator and once with the
    second; each layer then replays the graphs of the communicator it currently holds (the
    second inside ``TPGroupSwap``). Returns both captures' LayerGraphs (release them all)."""
    first = capture()
    layers = [layer for chunk in chunks for layer in chunk.layers.values()]
    replays_first = [layer.__dict__.pop("forward") for layer in layers]
    try:
        with TPGroupSwap(chunks, first_group, second_group), _own_capture_stream():
            second = capture()
    except BaseException:
        with contextlib.suppress(Exception):  # (the capture's error is the one to see)
            release_all(first)
        raise
    for layer, replay_first in zip(layers, replays_first):
        replay_second = layer.forward
        layer.forward = _by_group(layer.tp, second_group, replay_first, replay_second)
    return first + second


@contextlib.contextmanager
def _own_capture_stream():
    """While inside, ``torch.cuda.graph`` captures on a new stream instead of its one default
    capture stream. cuBLAS keeps a workspace per (handle, stream), and a graph replays the
    workspace of the stream it was captured on: graphs captured on one stream share it, so two of
    them replayed at once on two streams (a pair's) would overwrite each other's split-K partial
    sums."""
    with capturing_on(torch.cuda.Stream()) if torch.cuda.is_available() else contextlib.nullcontext():
        yield


def _by_group(tp, second_group: Group, replay_first, replay_second):
    def forward(x: Tensor, seq=None) -> Tensor:
        return (replay_second if tp.group is second_group else replay_first)(x, seq)
    return forward


class _Cuts:
    """A micro-batch forward's cuts (GPTModel ``forward(..., cut=...)``): each piece's output as
    made, and the leaf (the same values, a graph of its own) the next piece read; a tied output
    layer's weight likewise (the parameter, and the leaf the output layer read)."""

    def __init__(self) -> None:
        self.hidden: list[tuple[Tensor, Tensor] | None] = []
        self.tied: tuple[Tensor, Tensor] | None = None

    def __call__(self, t: Tensor) -> Tensor:
        leaf = t.detach().requires_grad_(t.requires_grad)
        if isinstance(t, nn.Parameter):
            if self.tied is not None:
                raise RuntimeError("one tied weight is cut per forward")
            self.tied = (t, leaf)
        else:
            self.hidden.append((t, leaf))
        return leaf

    def root(self, k: int) -> tuple[Tensor, Tensor | None]:
        """Piece k's output and the gradient the next piece left on its leaf."""
        made, leaf = self.hidden[k]
        return made, leaf.grad

    def tied_root(self) -> tuple[Tensor, Tensor | None]:
        weight, leaf = self.tied
        return weight, leaf.grad


def run_backward_roots(roots: list[tuple[Tensor, Tensor]]) -> None:
    """One backward from several (tensor, gradient) roots: autograd sums what reaches a node from
    more than one of them before running it."""
    tensors, grads = zip(*roots)
    torch.autograd.backward(tensors, grads)
