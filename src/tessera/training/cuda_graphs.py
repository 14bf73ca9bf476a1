"""Per-layer CUDA graphs (``train.cuda_graphs``): each transformer layer's forward and backward
replayed from a captured graph, so a step launches two graph replays per layer and micro-batch
instead of the layer's dozens of kernels one Python call at a time.

Why: at tp=2 each GEMM is half as long as on one GPU, and the step measured bound by the host's
launch time (BENCHMARKS.md, session 5). torch's ``make_graphed_callables`` does the capture
(warm-up on a side stream, one shared memory pool, static input and output buffers, autograd
wired to the backward graph); this module only chooses the sample shapes and keeps the model's
layer call ``layer(x, seq)`` working, and hands back a ``LayerGraphs`` whose ``release()`` frees
the graphs before the process group is destroyed: ``destroy_process_group`` hangs while a graph
that captured NCCL work is alive (pytorch/pytorch#115388; seen here at tp=2 after a finished
run). The TP collectives inside a layer are captured with it
(NCCL supports graph capture), so the trainer captures after data parallelism has moved the
parameters into their buffers: a graph reads the storage it was captured with.

What it needs (config.validate refuses the rest, the trainer refuses a non-CUDA device): one
micro-batch's activations live in each layer's static buffers, so pp=1 (no micro-batches in
flight together); static shapes and no packed sequences; no dropout (the RNG tracker's streams
are not graph-safe); eager layers; not FSDP (zero=3 frees each layer's parameters after it;
zero 1/2's hooks that wait for a layer's gathered parameters are lifted for the capture and
registered again after it, so they run before each replay); with gradient-accumulation fusion,
gradient buffers that stay in place (zero 0/1), since the captured weight-gradient GEMMs add
into them. In eval mode a layer runs its ordinary forward (``make_graphed_callables`` switches
on ``module.training``).
"""

from __future__ import annotations

import contextlib
import gc

import torch
from torch import Tensor, nn


class LayerGraphs:
    """The CUDA graphs of some graphed layers. ``release()`` puts the layers' own forward back
    and frees the graphs (idempotent)."""

    def __init__(self, layers: list[nn.Module], graphs: list, data_parallel=None) -> None:
        self.layers, self.graphs, self.data_parallel = layers, graphs, data_parallel

    def release(self) -> None:
        layers, graphs, self.layers, self.graphs = self.layers, self.graphs, [], []
        for layer in layers:
            layer.__dict__.pop("forward", None)  # the instance attribute the graphing set
        _forget_fused(layers, self.data_parallel)
        try:
            if graphs and torch.cuda.is_available():
                torch.cuda.synchronize()  # no replay still running when its graph goes
        finally:  # freed even after a CUDA error, or destroying the process group would hang
            _reset(graphs)


def release_all(handles: list[LayerGraphs]) -> None:
    """``release()`` every handle, each even when one before it fails (a CUDA error in its
    synchronize): a set left alive would hang destroy_process_group. The first error is raised
    after all were released."""
    error = None
    for handle in handles:
        try:
            handle.release()
        except BaseException as e:  # noqa: BLE001 -- raised below, after the rest are freed
            error = error or e
    if error is not None:
        raise error


def _reset(graphs: list) -> None:
    for graph in graphs:
        graph.reset()


def _forget_fused(layers: list[nn.Module], data_parallel) -> None:
    """The layers' weights leave ``data_parallel.graph_fused``: their eager backward counts its
    fused gradients again (left in, it would only add them, and the step would drop them)."""
    if data_parallel is not None:
        data_parallel.graph_fused.difference_update(p for layer in layers for p in layer.parameters())


def fused_backward_done(layer: nn.Module, data_parallel):
    """The callback for after ``layer``'s backward replay: report its weights whose gradient
    GEMM the graph replays (None when it has none)."""
    if data_parallel is None:
        return None
    weights = [p for p in layer.parameters() if p in data_parallel.graph_fused]
    return (lambda: data_parallel.graphed_backward_done(weights)) if weights else None


def _live_graphs() -> list:
    """Every CUDAGraph the collector tracks. ``type(o)``, not ``isinstance``: a weakref proxy whose
    referent is gone (torch.compile leaves some) raises ReferenceError on ``isinstance``."""
    return [o for o in gc.get_objects() if issubclass(type(o), torch.cuda.CUDAGraph)]


class _AfterBackward(torch.autograd.Function):
    """Identity; its backward calls ``callback()`` first. Put in front of a graphed layer, it runs
    once the layer's backward graph has been replayed (the gradient of the layer's input exists)."""

    @staticmethod
    def forward(ctx, x: Tensor, callback) -> Tensor:
        ctx.callback = callback
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        ctx.callback()
        return grad, None


def after_backward(x: Tensor, callback) -> Tensor:
    """``x``, with ``callback()`` called when the gradient reaches it in backward."""
    return _AfterBackward.apply(x, callback)


def graph_layers(chunk: nn.Module, micro_batch: int, sequence_length: int, warmup: int = 3,
                 data_parallel=None, fused: bool = False) -> LayerGraphs:
    """Capture every transformer layer of ``chunk`` (``chunk.layers``) for inputs of
    ``[sequence_length, micro_batch, hidden]`` (sequence_length is this rank's: divided by tp
    under sequence parallelism), in the parameters' dtype and device. Layers are captured in
    forward order, the order they then run. Call ``release()`` on the result when done.

    ``data_parallel``: its forward pre-hooks that wait for the layers' gathered parameters
    (zero 1/2's overlapped gather) are lifted while capturing and registered again after
    (``DataParallel.gather_hooks_lifted``): they then run before every replay.
    ``fused`` (gradient-accumulation fusion, with ``data_parallel``): the layers' weight-gradient
    GEMMs, which add straight into the main gradients, are captured with them
    (``DataParallel.capture_fused``), and after each layer's backward replay the data-parallel
    bookkeeping is told that those gradients arrived (``graphed_backward_done``): the Python
    that counts them eagerly does not run inside a replay."""
    if fused and data_parallel is None:
        raise ValueError("graph_layers with fused weight gradients needs the DataParallel that counts them")
    layers = list(chunk.layers.values())
    if not layers:
        return LayerGraphs([], [])
    weight = next(layers[0].parameters())
    if weight.device.type != "cuda":
        raise ValueError(f"CUDA graphs need the layers on a CUDA device, not {weight.device}")
    hidden = chunk.cfg.hidden
    samples = tuple((torch.randn(sequence_length, micro_batch, hidden, dtype=weight.dtype, device=weight.device,
                                 requires_grad=True),) for _ in layers)
    torch.cuda.synchronize(weight.device)
    # make_graphed_callables keeps its graphs in closures only: find the ones it made
    before = {id(g) for g in _live_graphs()}
    fusing = data_parallel if fused else None
    try:
        capture(layers, samples, warmup, data_parallel, fused)
    except BaseException:  # the graphs captured so far would hang destroy_process_group
        _reset([g for g in _live_graphs() if id(g) not in before])
        for layer in layers:
            layer.__dict__.pop("forward", None)
        _forget_fused(layers, fusing)
        raise
    graphs = [g for g in _live_graphs() if id(g) not in before]
    handle = LayerGraphs(layers, graphs, fusing)
    if len(graphs) != 2 * len(layers):  # a forward and a backward graph per layer
        handle.release()
        raise RuntimeError(f"found {len(graphs)} CUDA graphs after capturing {len(layers)} layers, not "
                           f"{2 * len(layers)}: this torch keeps make_graphed_callables' graphs elsewhere, "
                           "so they could not be freed before the process group; set train.cuda_graphs=false")
    for layer, (sample,) in zip(layers, samples):
        _accept_unpacked_sequence(layer, sample.shape, sample.dtype, fused_backward_done(layer, fusing))
    return handle


def capture(layers: list[nn.Module], samples: tuple, warmup: int, data_parallel=None, fused: bool = False) -> None:
    """``make_graphed_callables`` on ``layers`` (it sets each one's ``forward``), with the
    data-parallel gather waits lifted off them (it refuses hooked modules; they come back after,
    also on an error) and, ``fused``, the weight-gradient GEMMs captured into the main gradients
    (fused weights get no gradient from autograd: ``allow_unused_input``)."""
    with contextlib.ExitStack() as stack:
        if data_parallel is not None:
            stack.enter_context(data_parallel.gather_hooks_lifted(layers))
        if fused:
            stack.enter_context(data_parallel.capture_fused())
        held = _accumulators_on_the_capture_stream(layers)  # noqa: F841 -- alive while capturing
        torch.cuda.make_graphed_callables(tuple(layers), samples, num_warmup_iters=warmup,
                                          allow_unused_input=fused)


def _accumulators_on_the_capture_stream(layers: list[nn.Module]) -> list:
    """Each layer parameter's AccumulateGrad node, made on the stream ``torch.cuda.graph`` will
    capture on (the step's, inside ``step_stream``), or the live one. Held through the capture,
    they are the nodes the graphs keep: autograd runs a gradient's hook on its node's stream.
    Unheld, the last layer's nodes were the ones its warm-up made on make_graphed_callables' own
    warm-up stream (its warm-up outputs stay alive through the captures), and every step handed
    that layer's gradients over to the step's stream (DataParallel._on_grad)."""
    if not torch.cuda.is_available():  # (no streams: a CPU test's stand-in for the capture)
        return []
    if torch.cuda.graph.default_capture_stream is None:  # (as torch.cuda.graph makes it)
        torch.cuda.graph.default_capture_stream = torch.cuda.Stream()
    with torch.enable_grad(), torch.cuda.stream(torch.cuda.graph.default_capture_stream):
        return [p.view_as(p).grad_fn.next_functions[0][0]
                for layer in layers for p in layer.parameters() if p.requires_grad]


@contextlib.contextmanager
def step_stream(device: torch.device):
    """Inside, a new stream is ``device``'s current stream and the one ``torch.cuda.graph``
    captures on; the trainer captures its graphed layers and trains in it. Why: autograd runs a
    parameter's gradient hook on the stream its AccumulateGrad node was made on, and the nodes a
    capture makes live as long as its graphs and serve every later step. Captured on torch's
    side stream, every graphed gradient reached DataParallel on that stream and needed a handover
    to the step's (an event, a wait and a stream switch per gradient: GPT-1.3B at tp=2 + SP ran
    ~10 % slower, 2x H100, session 17); captured on the step's own stream, they arrive where the
    step runs. (The legacy default stream cannot be captured on, nor made to wait for a capture:
    hence a stream of its own.) Put back on leaving, the old stream waiting for this one."""
    stream, before = torch.cuda.Stream(device), torch.cuda.current_stream(device)
    stream.wait_stream(before)
    try:
        with capturing_on(stream), torch.cuda.stream(stream):
            yield stream
    except BaseException:
        with contextlib.suppress(Exception):  # (after a CUDA error: the first error is the one to see)
            before.wait_stream(stream)
        raise
    before.wait_stream(stream)


@contextlib.contextmanager
def capturing_on(stream):
    """While inside, ``torch.cuda.graph`` captures on ``stream`` (its class attribute
    ``default_capture_stream``, which make_graphed_callables' captures use); put back after."""
    before = torch.cuda.graph.default_capture_stream
    torch.cuda.graph.default_capture_stream = stream
    try:
        yield
    finally:
        torch.cuda.graph.default_capture_stream = before


def graph_stage(chunks: list[nn.Module], cfg, data_parallel=None, fused: bool = False) -> list[LayerGraphs]:
    """Capture the layers of this rank's model chunks for the configuration's micro-batch and
    (under sequence parallelism, per-rank) sequence length; a failure releases what was taken.
    ``data_parallel``, ``fused``: as for ``graph_layers``."""
    p = cfg.parallel
    seq = cfg.model.seq_len // (p.tp if p.sequence_parallel else 1)
    graphs: list[LayerGraphs] = []
    try:
        for chunk in chunks:
            graphs.append(graph_layers(chunk, cfg.train.micro_batch, seq, data_parallel=data_parallel,
                                       fused=fused))
    except BaseException:
        with contextlib.suppress(Exception):  # (the capture's error is the one to see)
            release_all(graphs)
        raise
    return graphs


def _accept_unpacked_sequence(layer: nn.Module, shape: torch.Size, dtype: torch.dtype, done=None) -> None:
    """The graphed forward takes exactly the captured tensors; the model calls ``layer(x, seq)``
    with an empty ``PackedSequence``: in training accept that, refuse packed positions or
    documents and an input of another shape or dtype than captured (the graph would broadcast or
    cast into its static input). In eval mode the layer's own forward runs, with any input.
    ``done``: called after each backward replay (fused weight gradients)."""
    graphed = layer.forward

    def forward(x: Tensor, seq=None) -> Tensor:
        if not layer.training:
            return type(layer).forward(layer, x, seq)
        if seq is not None and (seq.position_ids is not None or seq.document_ids is not None):
            raise ValueError("a CUDA-graphed layer runs unpacked sequences only: turn train.cuda_graphs off "
                             "for data.reset_position_ids / data.reset_attention_mask")
        if x.shape != shape or x.dtype != dtype:
            raise ValueError(f"a CUDA-graphed layer was captured for {tuple(shape)} {dtype} inputs, "
                             f"got {tuple(x.shape)} {x.dtype}")
        if done is None:
            return graphed(x)
        if not x.requires_grad:  # (a frozen embedding's output: the replay adds the fused gradients
            x = x.detach().requires_grad_()  # all the same, and after_backward must report them)
        return graphed(after_backward(x, done))

    layer.forward = forward
