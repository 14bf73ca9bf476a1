"""Per-layer CUDA graphs (``train.cuda_graphs``): each transformer layer's forward and backward
replayed from a captured graph, two graph launches per layer and micro-batch instead of the
layer's dozens of kernels, for layouts whose steps are bound by the host's launches (tp > 1).

torch's ``make_graphed_callables`` does the capture (warm-up on a side stream, one memory pool,
static inputs and outputs, autograd wired to the backward graph); this module captures each
layer's :meth:`~tessera.models.transformer.TransformerLayer.block` and hands the layer its
replay (``layer.use_graph``). A graph reads the storage it was captured with, so capture comes
after data parallelism has placed the parameters in their buffers; the TP collectives inside a
layer are captured with it. :class:`LayerGraphs` frees the graphs before the process group is
destroyed: ``destroy_process_group`` hangs while a graph that captured NCCL work is alive
(pytorch/pytorch#115388).

What capture needs (``training/plan.py`` refuses the rest): pp=1 (one micro-batch's activations
per graph), static shapes and no packed sequences, no dropout (the RNG tracker's streams are not
graph-safe), eager layers, not FSDP; zero 1/2's gather-waiting hooks are lifted for the capture
and run before each replay; fused weight gradients need gradient buffers that stay in place
(zero 0/1). In eval mode a layer runs its block eagerly.
"""

from __future__ import annotations

import contextlib
import gc

import torch
from torch import Tensor, nn


class LayerGraphs:
    """The CUDA graphs of some graphed layers. ``release()`` gives the layers their eager block
    back and frees the graphs (idempotent)."""

    def __init__(self, layers: list[nn.Module], graphs: list, data_parallel=None) -> None:
        self.layers, self.graphs, self.data_parallel = layers, graphs, data_parallel

    def release(self) -> None:
        layers, graphs, self.layers, self.graphs = self.layers, self.graphs, [], []
        for layer in layers:
            layer.use_graph(None)
        _forget_fused(layers, self.data_parallel)
        try:
            if graphs and torch.cuda.is_available():
                torch.cuda.synchronize()  # no replay still running when its graph goes
        finally:  # freed even after a CUDA error, or destroying the process group would hang
            for graph in graphs:
                graph.reset()


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


class _Block(nn.Module):
    """A layer's block as ``make_graphed_callables`` takes it: a module of its own (torch sets
    this one's ``forward`` to the graphed one), whose parameters are the layer's."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer

    def forward(self, x: Tensor) -> Tensor:
        return self.layer.block(x)


def graph_layers(chunk: nn.Module, micro_batch: int, sequence_length: int, warmup: int = 3,
                 data_parallel=None, fused: bool = False) -> LayerGraphs:
    """Capture every transformer layer of ``chunk`` for inputs of ``[sequence_length, micro_batch,
    hidden]`` (this rank's sequence length: divided by tp under sequence parallelism) in the
    parameters' dtype and device, in forward order. ``data_parallel``: its gather waits are lifted
    for the capture. ``fused``: the layers' weight-gradient GEMMs into the main gradients are
    captured too, and each backward replay reports their arrival. Release the result when done."""
    if fused and data_parallel is None:
        raise ValueError("graph_layers with fused weight gradients needs the DataParallel that counts them")
    layers = list(chunk.layers.values())
    if not layers:
        return LayerGraphs([], [])
    weight = next(layers[0].parameters())
    if weight.device.type != "cuda":
        raise ValueError(f"CUDA graphs need the layers on a CUDA device, not {weight.device}")
    samples = tuple((torch.randn(sequence_length, micro_batch, chunk.cfg.hidden, dtype=weight.dtype,
                                 device=weight.device, requires_grad=True),) for _ in layers)
    torch.cuda.synchronize(weight.device)
    # make_graphed_callables keeps its graphs in closures only: find the ones it made
    before = {id(g) for g in _live_graphs()}
    fusing = data_parallel if fused else None
    blocks = [_Block(layer) for layer in layers]
    try:
        capture(blocks, samples, warmup, data_parallel, fused)
    except BaseException:  # the graphs captured so far would hang destroy_process_group
        for graph in _live_graphs():
            if id(graph) not in before:
                graph.reset()
        _forget_fused(layers, fusing)
        raise
    graphs = [g for g in _live_graphs() if id(g) not in before]
    handle = LayerGraphs(layers, graphs, fusing)
    if len(graphs) != 2 * len(layers):  # a forward and a backward graph per layer
        handle.release()
        raise RuntimeError(f"found {len(graphs)} CUDA graphs after capturing {len(layers)} layers, not "
                           f"{2 * len(layers)}: this torch keeps make_graphed_callables' graphs elsewhere, "
                           "so they could not be freed before the process group; set train.cuda_graphs=false")
    for layer, block, (sample,) in zip(layers, blocks, samples):
        layer.use_graph(replay(block, sample.shape, sample.dtype, fused_backward_done(layer, fusing)))
    return handle


def capture(modules: list[nn.Module], samples: tuple, warmup: int, data_parallel=None, fused: bool = False) -> None:
    """``make_graphed_callables`` on ``modules`` (layers' blocks), with the data-parallel gather
    waits lifted off the layers inside (their hooks would run in the capture; they come back
    after, also on an error) and, ``fused``, the weight-gradient GEMMs captured into the main
    gradients (fused weights get no gradient from autograd: ``allow_unused_input``)."""
    layers = [getattr(m, "layer", m) for m in modules]
    with contextlib.ExitStack() as stack:
        if data_parallel is not None:
            stack.enter_context(data_parallel.gather_hooks_lifted(layers))
        if fused:
            stack.enter_context(data_parallel.capture_fused())
        held = _accumulators_on_the_capture_stream(layers)  # noqa: F841 -- alive while capturing
        torch.cuda.make_graphed_callables(tuple(modules), samples, num_warmup_iters=warmup,
                                          allow_unused_input=fused)


def _accumulators_on_the_capture_stream(layers: list[nn.Module]) -> list:
    """Each layer parameter's AccumulateGrad node, made on the stream the graphs capture on (the
    step's, inside :func:`step_stream`) and held through the capture, so the graphs keep these
    nodes: autograd runs a gradient's hook on its node's stream, and nodes made on torch's
    warm-up stream would make every later step hand its gradients over between streams."""
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
    captures on; the trainer captures its graphed layers and trains in it, so the gradients the
    graphs' AccumulateGrad nodes produce arrive on the stream the step runs on (captured on
    torch's side stream, each needed a handover: BENCHMARKS.md, tensor parallelism). The legacy
    default stream can be neither captured on nor made to wait for a capture, hence a stream of
    its own. Put back on leaving, the old stream waiting for this one."""
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
    (under sequence parallelism, per-rank) sequence length; a failure releases what was taken."""
    p = cfg.parallel
    seq = cfg.model.seq_len // (p.tp if p.sequence_parallel else 1)
    graphs: list[LayerGraphs] = []
    try:
        for chunk in chunks:
            graphs.append(graph_layers(chunk, cfg.train.micro_batch, seq, data_parallel=data_parallel, fused=fused))
    except BaseException:
        with contextlib.suppress(Exception):  # (the capture's error is the one to see)
            release_all(graphs)
        raise
    return graphs


def replay(graphed, shape: torch.Size, dtype: torch.dtype, done=None):
    """The function a graphed layer runs in training: ``graphed(x)`` for exactly the captured input
    shape and dtype and an unpacked sequence (the graph would broadcast or cast into its static
    input, and cannot follow packed documents); ``done`` is called after each backward replay
    (fused weight gradients)."""

    def run(x: Tensor, seq=None) -> Tensor:
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

    return run
