"""Micro-batch pairs on two streams with two TP communicators (parallel.tp_microbatch_pairs,
training/concurrent.py). On gloo there are no streams: a pair runs one after the other, which
checks everything but the overlap itself: the second micro-batch's collectives go over the
second communicator, each micro-batch's gradients arrive in data parallelism as usual, an odd
last micro-batch runs alone, and training equals the run without pairs."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
from torch import nn

from test_data_parallel import BASE, my_micro_batches
from tessera.config import ConfigError, ModelConfig, load_config, validate
from tessera.tensor_parallel import RNGTracker
from tessera.testing import run_ranks
from tessera.topology import Topology
from tessera.training.concurrent import PairedExecutor, TPGroupSwap
from tessera.training.step import train_step
from tessera.training.trainer import Stage, build_data_parallel

STEPS = 3


def _counting(calls: dict[str, int], groups: dict[int, str], inside: list[bool]):
    """Patches of the TP collectives (all-reduce; the SP all-gather and reduce-scatter) that
    count, per communicator, the calls made inside an executor's run."""
    from tessera.tensor_parallel import mappings

    def wrap(fn):
        def call(*args, group=None, **kwargs):
            if inside[0]:
                name = groups.get(id(group), "other")
                calls[name] = calls.get(name, 0) + 1
            return fn(*args, group=group, **kwargs)
        return call
    return [(owner, name, getattr(owner, name), wrap(getattr(owner, name)))
            for owner, name in ((dist, "all_reduce"), (mappings, "all_gather_single"),
                                (mappings, "reduce_scatter_single"))]


def _train(topo: Topology, overrides: list[str], count: int) -> dict:
    """STEPS steps on the first ``count`` micro-batches of each dp rank's share; the TP
    collectives of the executor's runs counted per communicator."""
    cfg = validate(load_config(None, BASE + overrides), topo.world_size)
    stage = Stage(cfg, topo, RNGTracker.for_rank(cfg.train.seed, topo.tp_rank, topo.pp_rank))
    data_parallel, optimizer = build_data_parallel(stage, topo, cfg)
    calls: dict[str, int] = {}
    inside = [False]
    patches = _counting(calls, {id(topo.group("tp")): "first", id(getattr(stage, "second_tp", None)): "second"},
                        inside)
    losses, norms = [], []
    for owner, name, _, new in patches:
        setattr(owner, name, new)
    try:
        for step in range(STEPS):
            micro_batches = my_micro_batches(step, topo)[:count]
            executor = stage.executor(len(micro_batches))
            run = executor.run

            def counted(*args, run=run, **kwargs):
                inside[0] = True
                try:
                    return run(*args, **kwargs)
                finally:
                    inside[0] = False
            executor.run = counted
            try:
                r = train_step(optimizer, micro_batches, topo, executor, data_parallel,
                               clip_grad=cfg.optim.clip_grad)
            finally:
                del executor.run
            losses.append(r.loss)
            norms.append(r.grad_norm)
    finally:
        for owner, name, old, _ in patches:
            setattr(owner, name, old)
    if hasattr(data_parallel, "wait_param_gather"):  # zero 1/2: the last update's gather overlaps nothing now
        data_parallel.wait_param_gather()
    params = {n: p.detach().clone() for n, p in stage.model.named_parameters()}
    return dict(losses=losses, norms=norms, params=params, calls=calls, paired=isinstance(executor, PairedExecutor),
                in_turn=getattr(executor, "backward_in_turn", False))


def _worker(rank: int, world: int, tp: int, overrides: list[str], count: int, in_turn: bool = False) -> dict:
    topo = Topology.build(tp=tp)
    layout = [f"parallel.tp={tp}", *overrides]
    out = {pairs: _train(topo, layout + [f"parallel.tp_microbatch_pairs={pairs}"], count)
           for pairs in ("false", "true")}
    if in_turn:
        # (the backwards issued piece by piece in turn: PairedExecutor.backward_in_turn)
        out["in_turn"] = _train(topo, layout + ["parallel.tp_microbatch_pairs=true",
                                                "parallel.tp_pairs_backward=in_turn"], count)
    return out


def _assert_same(paired: dict, plain: dict, what: str) -> None:
    """The same training, to the bit: the same sums in the same order."""
    assert paired["losses"] == plain["losses"] and paired["norms"] == plain["norms"], what
    for name, p in paired["params"].items():
        assert torch.equal(p, plain["params"][name]), f"{what}: {name}"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("tp,dp,extra,count,in_turn", [
    (2, 1, [], 8, False),  # four pairs
    (2, 1, [], 5, True),  # two pairs and an odd last micro-batch alone; tied embeddings
    (2, 1, ["model.tie_embeddings=false"], 4, True),  # an output layer of its own
    (2, 2, ["parallel.zero=1"], 4, True),  # zero 1's overlapped reduce-scatter, and gather (the first pair waits for it)
    (2, 2, ["parallel.zero=2"], 3, False),  # zero 2 reduces every micro-batch's gradients
])
def test_pairs_train_as_the_micro_batches_one_by_one(tp, dp, extra, count, in_turn):
    """Also with the backwards issued piece by piece in turn (``in_turn``), which cuts each
    forward into pieces: the same sums in the same order, to the bit."""
    for rank, out in enumerate(run_ranks(_worker, tp * dp, tp, extra, count, in_turn, timeout=240)):
        plain, paired = out["false"], out["true"]
        assert paired["paired"] and not plain["paired"]
        _assert_same(paired, plain, f"tp={tp} dp={dp} {extra} {count} micro-batches, rank {rank}")
        _assert_second_communicator(paired, plain, count, STEPS)
        assert not paired["in_turn"]
        if in_turn:
            assert out["in_turn"]["in_turn"]
            _assert_same(out["in_turn"], plain, f"in turn: tp={tp} dp={dp} {extra} {count} micro-batches, rank {rank}")
            _assert_second_communicator(out["in_turn"], plain, count, STEPS)


def _assert_second_communicator(paired: dict, plain: dict, count: int, steps: int) -> None:
    """The second micro-batch of each pair, forward and backward, used the second communicator,
    exactly as often as a micro-batch uses the first."""
    per_microbatch, rest = divmod(plain["calls"]["first"], count * steps)
    assert per_microbatch > 0 and rest == 0 and "second" not in plain["calls"], plain["calls"]
    pairs = count // 2
    assert paired["calls"] == {"first": per_microbatch * (count - pairs) * steps,
                               "second": per_microbatch * pairs * steps}, (paired["calls"], per_microbatch)


def _sequence_parallel_worker(rank: int, world: int) -> dict:
    return _worker(rank, world, 2, ["parallel.sequence_parallel=true"], 6, True)


@pytest.mark.timeout(300)
def test_pairs_under_sequence_parallelism():
    for rank, out in enumerate(run_ranks(_sequence_parallel_worker, 2, timeout=240)):
        assert out["true"]["paired"]
        for name in ("true", "in_turn"):
            _assert_same(out[name], out["false"], f"tp=2 + SP ({name}), rank {rank}")
            _assert_second_communicator(out[name], out["false"], 6, STEPS)


class _Stream:
    """A stand-in CUDA stream that logs what waits for what."""

    def __init__(self, name: str, log: list[str]):
        self.name, self.log = name, log

    def wait_stream(self, other: "_Stream") -> None:
        self.log.append(f"{self.name} waits for {other.name}")


def _current_stream_stand_in(name: str):
    """A stand-in for torch.cuda's current stream: ``current[0]`` names it, ``stream(s)`` is
    torch.cuda.stream for stand-in streams (``s.name`` current inside, put back after)."""
    current = [name]

    @contextlib.contextmanager
    def stream(s):
        before, current[0] = current[0], s.name
        try:
            yield
        finally:
            current[0] = before
    return current, stream


def _logged_executor(log: list[str], **kwargs) -> PairedExecutor:
    """A PairedExecutor over stand-in streams whose forwards (three pieces each: F<i>.<piece>)
    and stream switches go to ``log``; each micro-batch's loss is its ``i``."""
    where = ["current"]

    class Logged(PairedExecutor):
        def _steps(self, batch, global_tokens, cut=None):
            for piece in range(3):
                log.append(f"F{batch['i']}.{piece} on {where[0]}")
                yield None if piece < 2 else torch.ones((), requires_grad=True) * batch["i"]

        @contextlib.contextmanager
        def _on_side(self):
            before, where[0] = where[0], "side"
            try:
                yield
            finally:
                where[0] = before

        @staticmethod
        def _current():
            return current

    current = _Stream("current", log)
    model = nn.Linear(1, 1)
    model.tp_group = object()
    executor = Logged(model, model.tp_group, object(), _Stream("side", log), **kwargs)
    executor.where = where
    return executor


@pytest.mark.parametrize("gathers", [False, True])
def test_pairs_issue_the_forwards_piece_by_piece_in_turn_then_two_backwards(monkeypatch, gathers):
    """The order a pair's work is issued in, with stand-in streams (the backwards one after the
    other here): the two forwards a piece each in turn, the second's on the side stream, which
    waits for the current one before the pair (after each of the first forward's pieces, in the
    step's first pair, where zero 1/2's gather waits in that forward); the first backward, then
    the second on the side stream; the current stream waiting for the side stream after each
    pair; an odd last micro-batch alone on the current stream."""
    from tessera.training import concurrent

    log: list[str] = []
    executor = _logged_executor(log, gathers_in_forward=gathers, concurrent_backward=False)
    monkeypatch.setattr(concurrent, "run_backward",
                        lambda out, grad: log.append(f"B{int(out.item())} on {executor.where[0]}"))
    loss = executor.run([{"i": i} for i in range(5)], torch.tensor(1.0))
    assert loss.item() == 0 + 1 + 2 + 3 + 4

    def forwards(a, b, wait_each):
        out = [] if wait_each else ["side waits for current"]
        for piece in range(3):
            out.append(f"F{a}.{piece} on current")
            out += ["side waits for current"] if wait_each else []
            out.append(f"F{b}.{piece} on side")
        return out
    assert log == [*forwards(0, 1, gathers), "B0 on current", "B1 on side", "current waits for side",
                   *forwards(2, 3, False), "B2 on current", "B3 on side", "current waits for side",
                   "F4.0 on current", "F4.1 on current", "F4.2 on current", "B4 on current"]


def test_an_error_in_a_pair_still_has_the_current_stream_wait_for_the_side(monkeypatch):
    """A backward that fails leaves the side stream's work of the pair waited for by the current
    stream all the same (what follows, a retried step, must not overtake it)."""
    from tessera.training import concurrent

    log: list[str] = []
    executor = _logged_executor(log, concurrent_backward=False)

    def failing(out, grad):
        raise RuntimeError("backward failed")
    monkeypatch.setattr(concurrent, "run_backward", failing)
    with pytest.raises(RuntimeError, match="backward failed"):
        executor.run([{"i": 0}, {"i": 1}], torch.tensor(1.0))
    assert log[-1] == "current waits for side", log


def test_backward_in_turn_is_refused_where_the_backwards_run_one_after_the_other():
    executor = _logged_executor([], concurrent_backward=False)
    with pytest.raises(ValueError, match="backward_in_turn interleaves.*zero=2"):
        executor.backward_in_turn = True
    assert not executor.backward_in_turn
    executor.backward_in_turn = False  # (turning it off is always fine)


def test_backward_in_turn_issues_both_micro_batches_piece_by_piece(monkeypatch):
    """backward_in_turn: this thread issues both backwards, the losses first, then each piece
    from the last, the two micro-batches in turn, the second's on the side stream; a tied weight
    joins the first piece's backward (its two gradients summed before its accumulate hook: one
    hook call per micro-batch); the gradients are those of one backward per micro-batch."""
    from tessera.training import concurrent

    log: list[str] = []
    where = ["current"]
    weight = nn.Parameter(torch.tensor(2.0))
    names: dict[int, str] = {id(weight): "W"}

    class Pieces(PairedExecutor):
        def _steps(self, batch, global_tokens, cut=None):
            i = batch["i"]
            x = weight * i  # the "embedding", reading the tied weight
            names[id(x)] = f"{i}.0"
            yield None
            x = cut(x) * 3  # a "layer"
            names[id(x)] = f"{i}.1"
            yield None
            yield cut(x) * cut(weight)  # the "output layer" and loss, reading the tied weight again

        @contextlib.contextmanager
        def _on_side(self):
            before, where[0] = where[0], "side"
            try:
                yield
            finally:
                where[0] = before

        @staticmethod
        def _current():
            return current

    run_backward, run_roots = concurrent.run_backward, concurrent.run_backward_roots

    def logged_backward(out, grad):
        log.append(f"loss on {where[0]}")
        run_backward(out, grad)

    def logged_roots(roots):
        log.append(f"{'+'.join(names[id(t)] for t, _ in roots)} on {where[0]}")
        run_roots(roots)
    monkeypatch.setattr(concurrent, "run_backward", logged_backward)
    monkeypatch.setattr(concurrent, "run_backward_roots", logged_roots)
    hooks = []
    weight.register_post_accumulate_grad_hook(lambda p: hooks.append(p.grad.item()))
    current = _Stream("current", log)
    model = nn.Linear(1, 1)
    model.tp_group = object()
    executor = Pieces(model, model.tp_group, object(), _Stream("side", log))
    executor.backward_in_turn = True
    executor.run([{"i": 1}, {"i": 2}], torch.tensor(1.0))
    assert log == ["side waits for current", "loss on current", "loss on side", "1.1 on current", "2.1 on side",
                   "1.0+W on current", "2.0+W on side", "current waits for side"], log
    # loss_i = 3 i w * w: d/dw = 6 i w; one hook call per micro-batch, with both terms
    assert hooks == [6 * 1 * 2.0, 6 * 1 * 2.0 + 6 * 2 * 2.0]
    assert weight.grad.item() == 6 * (1 + 2) * 2.0


def test_the_two_backwards_run_at_once_and_their_errors_surface(monkeypatch):
    """With a side stream the second backward runs on a worker thread while the first runs here
    (the first waits here until the second has started, so run one after the other they would
    deadlock), on the side stream; the second's error is raised by ``run``, and an error of the
    first is raised only after the second has finished."""
    import threading

    from tessera.training import concurrent

    log: list[str] = []
    executor = _logged_executor(log)
    assert executor.concurrent_backward
    second_started, second_done = threading.Event(), threading.Event()
    fail = {}

    def backward(out, grad):
        i = int(out.item())
        if i == 0:
            assert second_started.wait(timeout=10), "the second backward did not start while the first ran"
            if "first" in fail:
                raise RuntimeError("first failed")
        else:
            assert threading.current_thread() is not threading.main_thread() and executor.where[0] == "side"
            second_started.set()
            if "second" in fail:
                raise RuntimeError("second failed")
            second_done.set()

    monkeypatch.setattr(concurrent, "run_backward", backward)
    assert executor.run([{"i": 0}, {"i": 1}], torch.tensor(1.0)).item() == 1
    assert second_done.is_set()
    for which in ("second", "first"):
        second_started.clear(), second_done.clear()
        fail.clear()
        fail[which] = True
        with pytest.raises(RuntimeError, match=f"{which} failed"):
            executor.run([{"i": 0}, {"i": 1}], torch.tensor(1.0))
        assert which == "second" or second_done.is_set()


def test_concurrent_backwards_give_the_gradients_of_one_after_the_other():
    """Real autograd on two threads (a CPU runs each backward on its own thread): every
    parameter gets the sum of the two micro-batches' gradients, as one after the other."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1)).double()
    batches = [torch.randn(4, 8, dtype=torch.float64) for _ in range(2)]
    expected = [torch.zeros_like(p) for p in model.parameters()]
    for x in batches:
        for e, g in zip(expected, torch.autograd.grad(model(x).sum(), list(model.parameters()))):
            e += g
    executor = PairedExecutor(model, object(), object(), None)
    executor.concurrent_backward = True  # (a CPU has no side stream; the path is the same)
    for _ in range(3):
        model.zero_grad()
        executor._backwards(model(batches[0]).sum(), model(batches[1]).sum())
        for e, p in zip(expected, model.parameters()):
            torch.testing.assert_close(p.grad, e, rtol=1e-12, atol=1e-12)


def test_the_second_backward_hides_only_torchs_stream_mismatch_warning(monkeypatch):
    """One after the other, the second micro-batch's backward runs with torch's AccumulateGrad
    stream-mismatch warning hidden (its gradients reach the nodes made on the step's stream from
    the side stream, by design); the first's shows it, and any other warning passes."""
    import warnings

    from tessera.training import concurrent

    mismatch = "The AccumulateGrad node's stream does not match the stream of the node that produced"

    def backward(out, grad):
        warnings.warn(f"{mismatch} (micro-batch {int(out.item())})")
        warnings.warn(f"another warning (micro-batch {int(out.item())})")

    monkeypatch.setattr(concurrent, "run_backward", backward)
    executor = _logged_executor([], concurrent_backward=False)
    executor._on_side = contextlib.nullcontext
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        executor.run([{"i": 1}, {"i": 2}], torch.tensor(1.0))
    assert [str(w.message) for w in caught] == [f"{mismatch} (micro-batch 1)", "another warning (micro-batch 1)",
                                                "another warning (micro-batch 2)"]


def test_concurrent_backwards_run_with_torchs_stream_check_off_and_put_it_back(monkeypatch):
    """At once, the two backwards run with torch's AccumulateGrad stream check switched off
    (a warning filter would be global state shared with the other thread), the switch put back
    after, also after an error; other warnings pass."""
    import warnings

    from tessera.training import concurrent

    switch = torch.autograd.graph.set_warn_on_accumulate_grad_stream_mismatch
    state = torch._C._warn_on_accumulate_grad_stream_mismatch
    checked = []

    def backward(out, grad):
        checked.append(state())
        warnings.warn(f"another warning (micro-batch {int(out.item())})")

    monkeypatch.setattr(concurrent, "run_backward", backward)
    executor = _logged_executor([])
    executor._on_side = contextlib.nullcontext
    for before in (True, False):
        switch(before)
        try:
            checked.clear()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                executor.run([{"i": 1}, {"i": 2}], torch.tensor(1.0))
            assert checked == [False, False] and state() == before
            assert sorted(str(w.message) for w in caught) == ["another warning (micro-batch 1)",
                                                              "another warning (micro-batch 2)"]
        finally:
            switch(True)

    def failing(out, grad):
        raise RuntimeError("backward failed")
    monkeypatch.setattr(concurrent, "run_backward", failing)
    for before in (True, False):
        switch(before)
        try:
            with pytest.raises(RuntimeError, match="backward failed"):
                executor.run([{"i": 1}, {"i": 2}], torch.tensor(1.0))
            assert state() == before
        finally:
            switch(True)


def test_graph_pairs_capture_per_communicator_and_dispatch_by_the_group_held():
    """graph_pairs with a stand-in capture (no CUDA): the second capture runs with the layers
    holding the second communicator; each layer then replays the capture of the group it holds;
    releasing puts the layers' own forward back; a failed second capture releases the first."""
    from tessera.models.transformer import TPContext
    from tessera.training.concurrent import graph_pairs

    first, second = object(), object()
    ctx = TPContext(group=first)

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.tp, self.tp_group = ctx, first

        def forward(self, x, seq=None):
            return "eager"

    chunk = nn.Module()
    chunk.layers = nn.ModuleDict({"0": Layer(), "1": Layer()})
    captured, released = [], []

    class Handle:
        def __init__(self, n):
            self.n = n

        def release(self):
            released.append(self.n)
            for layer in chunk.layers.values():
                layer.__dict__.pop("forward", None)

    def capture(fail_at=None):
        n = len(captured)
        captured.append(ctx.group)
        if n == fail_at:
            raise RuntimeError("capture failed")
        for name, layer in chunk.layers.items():
            layer.forward = lambda x, seq=None, n=n, name=name: (n, name, ctx.group is second)
        return [Handle(n)]

    handles = graph_pairs([chunk], capture, first, second)
    assert captured == [first, second] and ctx.group is first
    assert [chunk.layers[k](None) for k in "01"] == [(0, "0", False), (0, "1", False)]
    with TPGroupSwap([chunk], first, second):
        assert [chunk.layers[k](None) for k in "01"] == [(1, "0", True), (1, "1", True)]
    for h in handles:
        h.release()
    assert released == [0, 1] and chunk.layers["0"](None) == "eager"
    captured.clear(), released.clear()
    with pytest.raises(RuntimeError, match="capture failed"):
        graph_pairs([chunk], lambda: capture(fail_at=1), first, second)
    assert released == [0] and ctx.group is first and chunk.layers["1"](None) == "eager"


def test_tp_group_swap_swaps_every_reference_and_puts_them_back():
    from tessera.models.transformer import TPContext
    first, second = object(), object()
    ctx = TPContext(group=first)

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.tp_group, self.tp, self.other = first, ctx, "x"

    model = nn.Sequential(Layer(), nn.Sequential(Layer()))
    swap = TPGroupSwap([model], first, second)
    for _ in range(2):  # found once, swapped at every entry
        with swap:
            assert all(m.tp_group is second for m in model.modules() if isinstance(m, Layer))
            assert ctx.group is second and model[0].other == "x"
        assert all(m.tp_group is first for m in model.modules() if isinstance(m, Layer)) and ctx.group is first
    with pytest.raises(RuntimeError, match="boom"), TPGroupSwap([model], first, second):
        raise RuntimeError("boom")
    assert model[1][0].tp_group is first and ctx.group is first  # put back after an error too
    with pytest.raises(ValueError, match="a TP group"):
        with TPGroupSwap([model], None, second):
            pass


@pytest.mark.parametrize("sets,key", [
    (["parallel.tp=1"], "parallel.tp_microbatch_pairs"),
    (["parallel.tp=2", "parallel.pp=2"], "parallel.tp_microbatch_pairs"),
    (["parallel.tp=2", "train.compile=true"], "parallel.tp_microbatch_pairs"),
    (["parallel.tp=2", "train.grad_accum_fusion=true"], "parallel.tp_microbatch_pairs"),
    (["parallel.tp=2", "parallel.zero=3"], "parallel.tp_microbatch_pairs"),
    (["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.tp_async=p2p"], "parallel.tp_microbatch_pairs"),
])
def test_pairs_refused_where_they_cannot_run(sets, key):
    cfg = load_config(None, [*sets, "parallel.tp_microbatch_pairs=true"])
    p = cfg.parallel
    with pytest.raises(ConfigError) as e:
        validate(cfg, p.tp * p.pp * 2)
    assert e.value.key == key


@pytest.mark.parametrize("sets,problem", [
    (["parallel.tp_microbatch_pairs=auto"], "pairs are off"),
    (["parallel.tp_microbatch_pairs=false"], "pairs are off"),
    (["parallel.tp_microbatch_pairs=true", "parallel.zero=2"], "zero=2 runs a pair's two backwards one after"),
])
def test_backwards_in_turn_refused_without_pairs_to_interleave(sets, problem):
    cfg = load_config(None, ["parallel.tp=2", "parallel.tp_pairs_backward=in_turn", *sets])
    with pytest.raises(ConfigError, match=problem) as e:
        validate(cfg, 4)
    assert e.value.key == "parallel.tp_pairs_backward"


@pytest.mark.parametrize("sets, expected", [
    (["parallel.tp=2"], False),  # auto: off (an experimental path that may hang, trainer.microbatch_pairs)
    (["parallel.tp=2", "parallel.sequence_parallel=true"], False),
    (["parallel.tp=2", "parallel.tp_microbatch_pairs=false"], False),
    (["parallel.tp=2", "parallel.tp_microbatch_pairs=true"], True),
    (["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.tp_microbatch_pairs=true"], True),
])
def test_only_true_runs_pairs(sets, expected):
    """parallel.tp_microbatch_pairs: auto and false run no pairs (4 of 19 GPT-1.3B tp=2 + SP
    runs with them hung, session 19); true does."""
    from tessera.training.trainer import microbatch_pairs

    cfg = load_config(None, sets)
    validate(cfg, cfg.parallel.tp * cfg.parallel.pp)
    assert microbatch_pairs(cfg) is expected


def test_gradient_adds_run_on_the_steps_stream(monkeypatch):
    """DataParallel's hook, run by autograd on the stream the parameter's AccumulateGrad node was
    made on: on the step's stream it adds, with no stream calls but one id query; on another
    (graphs captured on a stream the step does not run on) the step's stream waits for that one,
    the gradient is recorded on the step's stream, the add runs there, the hook's stream put
    back after. Stand-in streams on a CPU."""
    from tessera.distributed import data_parallel
    from tessera.distributed.data_parallel import DataParallel

    log: list[str] = []
    current = [None]

    class Stream:
        def __init__(self, name):
            self.name = name

        def wait_event(self, event):
            log.append(f"{self.name} waits for {event.stream.name}")

    class Event:
        stream = None

        def record(self, stream):
            self.stream = stream

    def set_stream(stream):
        current[0] = stream
        log.append(f"on {stream.name}")

    step, side = Stream("step"), Stream("side")
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current[0])
    monkeypatch.setattr(data_parallel, "current_stream_id", lambda device: id(current[0]))
    monkeypatch.setattr(torch.cuda, "set_stream", set_stream)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda t, s: log.append(f"recorded on {s.name}"))
    model = nn.Linear(2, 2)
    dp = DataParallel([model], Topology.build(), bucket_size=10**6)
    dp.device = torch.device("cuda")  # (pretended: the streams above stand in)
    add = dp.accumulate
    monkeypatch.setattr(dp, "accumulate", lambda p, g: (log.append(f"add on {current[0].name}"), add(p, g)))
    current[0] = step
    dp.start_step(2)
    model(torch.ones(1, 2)).sum().backward()  # the hooks run on the step's stream: plain adds
    assert log == ["add on step", "add on step"]
    log.clear()
    current[0] = side  # where autograd runs the hooks of nodes made on another stream
    model(torch.ones(1, 2)).sum().backward()
    handover = ["step waits for side", "recorded on step", "on step", "add on step", "on side"]
    assert log == handover * 2 and current[0] is side


def test_step_stream_is_current_and_captured_on_then_put_back(monkeypatch):
    """cuda_graphs.step_stream: inside, a new stream (which waited for the old one) is current and
    torch.cuda.graph's capture stream; on leaving, also after an error, both are put back and the
    old stream waits for the new one. Stand-in streams on a CPU."""
    from tessera.training.cuda_graphs import step_stream

    log: list[str] = []
    current, stream = _current_stream_stand_in("default")
    default = _Stream("default", log)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: _Stream("new", log))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: default if current[0] == "default" else None)
    monkeypatch.setattr(torch.cuda, "stream", stream)
    monkeypatch.setattr(torch.cuda.graph, "default_capture_stream", "torch's")
    for fail in (False, True):
        log.clear()
        with contextlib.suppress(RuntimeError):
            with step_stream(torch.device("cuda")) as s:
                assert current[0] == "new" and torch.cuda.graph.default_capture_stream is s
                if fail:
                    raise RuntimeError("a step failed")
        assert current[0] == "default" and torch.cuda.graph.default_capture_stream == "torch's"
        assert log == ["new waits for default", "default waits for new"]


def test_graphs_keep_accumulators_made_on_the_capture_stream(monkeypatch):
    """cuda_graphs.capture makes every layer parameter's AccumulateGrad node on the capture
    stream and holds it through make_graphed_callables: the nodes the graphs keep (autograd runs
    each gradient's hook on its node's stream) are those, the last layer's too, whose warm-up
    outputs outlive its warm-up. torch's real make_graphed_callables, its CUDA calls stood in
    for on a CPU; a node is tagged where it is first seen."""
    from tessera.models import GPTModel
    from tessera.training import cuda_graphs

    current, stream = _current_stream_stand_in("legacy")
    @contextlib.contextmanager
    def graph(g, pool=None, **kwargs):  # torch.cuda.graph captures on its default capture stream
        with stream(graph.default_capture_stream):
            yield

    graph.default_capture_stream = _Stream("capture", [])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "Stream", lambda *a, **k: _Stream("warm-up", []))
    monkeypatch.setattr(torch.cuda, "stream", stream)
    monkeypatch.setattr(torch.cuda, "graph", graph)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: None)
    monkeypatch.setattr(torch.cuda.graphs, "graph_pool_handle", lambda: None)
    cfg = ModelConfig(family="gpt2", hidden=32, heads=4, layers=3, seq_len=16, vocab_size=64)
    layers = list(GPTModel(cfg).layers.values())
    params = [p for layer in layers for p in layer.parameters()]

    def node(p, tag):
        n = p.view_as(p).grad_fn.next_functions[0][0]
        n.metadata.setdefault("tag", tag)
        return n

    made_on = []  # the stream current while the capture's own nodes are made
    view_as = torch.Tensor.view_as
    monkeypatch.setattr(torch.Tensor, "view_as", lambda t, o: (made_on.append(current[0]), view_as(t, o))[1])
    held = cuda_graphs._accumulators_on_the_capture_stream(layers)
    assert len(held) == len(params) and set(made_on) == {"capture"} and current[0] == "legacy"
    monkeypatch.setattr(torch.Tensor, "view_as", view_as)
    del held

    for layer in layers:  # tag nodes as the layers' forwards use them: warm-up or capture
        def forward(x, *args, layer=layer, own=layer.forward):
            out = own(x, *args)
            for p in layer.parameters():
                node(p, current[0])
            return out
        layer.forward = forward
    real = torch.cuda.make_graphed_callables

    def graphed(*args, **kwargs):  # what is alive when it starts: the held nodes
        for p in params:
            node(p, "held")
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.cuda, "make_graphed_callables", graphed)
    samples = tuple((torch.randn(16, 2, 32, requires_grad=True),) for _ in layers)
    cuda_graphs.capture(layers, samples, 2)
    kept = [[node(p, "after").metadata["tag"] for p in layer.parameters()] for layer in layers]
    assert kept == [["held"] * len(k) for k in kept], kept


def test_the_second_graph_set_is_captured_on_a_stream_of_its_own(monkeypatch):
    """graph_pairs' second capture runs with torch.cuda.graph's default capture stream replaced by
    a new one (cuBLAS's workspace is per stream: two graph sets replayed at once must not share
    one), put back after, also when that capture fails. Stand-in streams on a CPU."""
    from tessera.training.concurrent import graph_pairs

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    made: list[str] = []

    def new_stream():
        made.append(f"stream {len(made) + 1}")
        return made[-1]
    monkeypatch.setattr(torch.cuda, "Stream", new_stream)
    before = "the default capture stream"
    monkeypatch.setattr(torch.cuda.graph, "default_capture_stream", before)
    chunk = nn.Module()
    chunk.layers = nn.ModuleDict()  # no layers: only the streams are watched
    seen = []

    def capture():
        seen.append(torch.cuda.graph.default_capture_stream)
        return []

    first, second = object(), object()
    graph_pairs([chunk], capture, first, second)
    assert seen == [before, "stream 1"] and torch.cuda.graph.default_capture_stream == before

    def failing():
        seen.append(torch.cuda.graph.default_capture_stream)
        if len(seen) == 4:
            raise RuntimeError("capture failed")
        return []
    with pytest.raises(RuntimeError, match="capture failed"):
        graph_pairs([chunk], failing, first, second)
    assert seen[2:] == [before, "stream 2"] and torch.cuda.graph.default_capture_stream == before


def test_the_second_backward_adds_on_the_side_while_the_two_run(monkeypatch):
    """With a DataParallel and side_adds, the concurrent backwards give it the pair's SideAdds for their
    duration (cleared after, also after an error) and mark the second loss, whose backward
    starts with the node that names its graph task; without side_adds, nothing is set."""
    import threading
    from types import SimpleNamespace

    from tessera.training import concurrent

    class Adds:
        def __init__(self, step, side, step_only):
            self.step, self.side, self.step_only = step, side, step_only

    seen = []

    def backward(out, grad):
        seen.append((int(out.item()), out.grad_fn.name(), data_parallel.side_adds))
        if out.item() == 0:
            while len(seen) < 2:  # (the second runs on the worker thread meanwhile)
                threading.Event().wait(0.01)

    monkeypatch.setattr(concurrent, "SideAdds", Adds)
    monkeypatch.setattr(concurrent, "run_backward", backward)
    executor = _logged_executor([])
    data_parallel = SimpleNamespace(side_adds=None)
    executor.data_parallel = data_parallel
    assert not executor.side_adds  # (off by default while the pairs may hang)
    executor.side_adds = True
    executor.run([{"i": 0}, {"i": 1}], torch.tensor(1.0))
    assert data_parallel.side_adds is None
    (first, second) = sorted(seen, key=lambda s: s[0])
    assert first[2] is second[2] and isinstance(first[2], Adds) and first[2].side.name == "side"
    assert first[2].step_only == set()  # (the stand-in losses use no parameter twice)
    assert second[1] == "MarkStartBackward" and first[1] != "MarkStartBackward"
    seen.clear()
    executor.side_adds = False
    executor.run([{"i": 0}, {"i": 1}], torch.tensor(1.0))
    assert [s[2] for s in seen] == [None, None] and all(s[1] != "MarkStartBackward" for s in seen)
    executor.side_adds = True

    def failing(out, grad):
        raise RuntimeError("backward failed")
    monkeypatch.setattr(concurrent, "run_backward", failing)
    with pytest.raises(RuntimeError, match="backward failed"):
        executor.run([{"i": 0}, {"i": 1}], torch.tensor(1.0))
    assert data_parallel.side_adds is None
