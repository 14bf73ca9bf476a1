"""Pipeline point-to-point (``P2P``) used directly, on 2 and 3 gloo ranks.

- tensors of every supported dtype and of 0 to 6 dimensions arrive intact, both directions;
- the shape header goes once per step, stream and peer: a later message of another shape (or
  dtype) in the same step is refused with ShapeError naming both; after ``new_step`` it works;
  with ``keep_shapes`` (the trainer's) once per run, and another shape in a later step is refused
  unless both ends renegotiate;
- streams F and B in flight at once between one pair, in both directions, with receives posted in
  another order than the sends, deliver each tensor to its own receive (tags);
- a receive posted before the sender sends, and a wait before the sender sends, still work.
A rank that dies: test_p2p_failures.py.

The multi-rank cases of one world size run in ONE ``run_ranks`` call; the parent checks the
results.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from tessera.pipeline_parallel.p2p import DTYPES, HEADER_TAG, P2P, ShapeError
from tessera.testing import run_ranks
from tessera.topology import Topology

SHAPES = [(), (5,), (2, 3), (2, 3, 4), (1, 2, 1, 3), (2, 1, 2, 1, 2), (1, 2, 1, 2, 1, 2)]  # 0-d to 6-d


def payload(shape: tuple, dtype: torch.dtype, salt: int) -> torch.Tensor:
    """A tensor whose every element says where it came from (exact in every dtype here)."""
    n = 1
    for s in shape:
        n *= s
    values = torch.arange(n, dtype=torch.float64).remainder(97) + 3 * salt
    if dtype.is_floating_point and dtype != torch.float64:
        values = values / 4  # fractional, still exact in fp16 / bf16 at these magnitudes
    return values.to(dtype).reshape(shape)


def dtype_cases() -> list[tuple[tuple, torch.dtype]]:
    """Every dtype and every number of dimensions (0 to 6), each at least once."""
    return [(SHAPES[i % len(SHAPES)], DTYPES[i % len(DTYPES)]) for i in range(2 * len(SHAPES))]


class _CountingIsend:
    """Wraps ``torch.distributed.isend`` to count the headers that P2P sends."""

    def __init__(self):
        self.original = dist.isend
        self.headers: list[tuple[int, int]] = []  # (dst, header ndim)

    def __call__(self, tensor, dst=None, group=None, tag=0, **kw):
        if tag == HEADER_TAG:
            self.headers.append((dst, int(tensor[0])))
        return self.original(tensor, dst, group=group, tag=tag, **kw)

    def __enter__(self):
        dist.isend = self
        return self

    def __exit__(self, *exc):
        dist.isend = self.original


# -- 2 ranks -------------------------------------------------------------------------------------------
def _two_rank_worker(rank: int, world_size: int) -> dict:
    topo = Topology.build(pp=2)
    p2p = P2P(topo)
    peer = 1 - rank
    out: dict = {}

    # 1. dtypes and dimensions, both directions (a new step for each: one header per tensor)
    received = []
    for i, (shape, dtype) in enumerate(dtype_cases()):
        p2p.new_step()
        stream = "F" if i % 2 == 0 else "B"
        if rank == i % 2:
            p2p.send(stream, peer, i, payload(shape, dtype, i))
        else:
            got = p2p.recv(stream, peer, i).wait()
            received.append((i, got))
        p2p.wait_sends()
    # a non-contiguous tensor is sent as its values
    p2p.new_step()
    if rank == 0:
        p2p.send("F", 1, 0, payload((4, 3), torch.float32, 5).t())
    else:
        received.append(("transposed", p2p.recv("F", 0, 0).wait()))
    p2p.wait_sends()
    out["received"] = received

    # 2. one header per step, stream and peer; a new step renegotiates
    p2p.new_step()
    if rank == 0:
        with _CountingIsend() as counter:
            for tag in (0, 1, 2, 10):
                p2p.send("F", 1, tag, payload((4, 3), torch.float32, tag))
            for tag in range(2):
                p2p.send("B", 1, tag, payload((2, 2), torch.int64, tag))
            headers_in_step = len(counter.headers)
            p2p.wait_sends()
            dist.barrier()
            p2p.new_step()
            p2p.send("F", 1, 3, payload((4, 2), torch.float32, 3))  # another shape: fine in a new step
            p2p.send("F", 1, 4, payload((4, 2), torch.float32, 4))
            p2p.wait_sends()
            headers_total = len(counter.headers)
        out.update(headers_in_step=headers_in_step, headers_total=headers_total,
                   header_dims=counter.headers)
    else:
        first = [p2p.recv("F", 0, tag) for tag in range(3)]
        grads = [p2p.recv("B", 0, tag) for tag in range(2)]
        step1 = [r.wait() for r in first] + [r.wait() for r in grads]
        # once the step's header is in, a receive is posted at once (it overlaps with compute)
        later = p2p.recv("F", 0, 10)
        posted_at_once = later.work is not None
        step1.append(later.wait())
        dist.barrier()
        p2p.new_step()
        late = [p2p.recv("F", 0, tag) for tag in (3, 4)]
        deferred_after_new_step = late[0].work is None  # the new step's first message has a header again
        step2 = [r.wait() for r in late]
        out.update(step1=step1, step2=step2, posted_at_once=posted_at_once,
                   deferred_after_new_step=deferred_after_new_step)
    dist.barrier()

    # 3. streams F and B at once, both directions, receives posted in another order than the sends
    p2p.new_step()
    tags = range(4)
    shapes = {"F": (3, 4), "B": (2, 5)}  # a different shape per stream, in the same step

    def value(stream, sender, tag):
        return torch.full(shapes[stream], float(1000 * sender + 100 * (stream == "B") + tag))

    for tag in tags:  # sends in sequence order: F0 B0 F1 B1 ...
        for stream in ("F", "B"):
            p2p.send(stream, peer, tag, value(stream, rank, tag))
    order = [("B", 3), ("F", 2), ("B", 0), ("F", 3), ("F", 0), ("B", 2), ("F", 1), ("B", 1)]
    if rank == 1:
        order.reverse()
    pending = {key: p2p.recv(key[0], peer, key[1]) for key in order}
    wait_order = order[1::2] + order[0::2]
    out["streams"] = {key: pending[key].wait() for key in wait_order}
    p2p.wait_sends()

    # 4. a receive posted before the sender sends; and a wait before the sender sends
    p2p.new_step()
    if rank == 1:
        early = p2p.recv("F", 0, 0)  # the step's first message: header not sent yet
        dist.barrier()
        out["early_first"] = early.wait()
        early = p2p.recv("F", 0, 1)  # shape known: payload posted now, before the send
        dist.barrier()
        out["early_second"] = early.wait()
        late = p2p.recv("F", 0, 2)
        out["wait_called"] = time.time()  # wall clock: both ranks are on this host
        dist.barrier()  # (rank 0 sends only after this rank is about to wait: the order is certain)
        out["waited"] = late.wait()  # rank 0 sends 0.5 s later
        out["wait_returned"] = time.time()
    else:
        dist.barrier()
        p2p.send("F", 1, 0, payload((3, 2), torch.float32, 0))
        dist.barrier()
        p2p.send("F", 1, 1, payload((3, 2), torch.float32, 1))
        dist.barrier()
        time.sleep(0.5)  # (the receiver waits meanwhile)
        out["sent"] = time.time()
        p2p.send("F", 1, 2, payload((3, 2), torch.float32, 2))
        p2p.wait_sends()
    dist.barrier()

    # 5. keep_shapes (the trainer's P2P): a header at the first step only; later steps' first
    # receives are posted at once; another shape in a later step is refused by the sender
    kept = P2P(topo, keep_shapes=True)
    if rank == 0:
        with _CountingIsend() as counter:
            for step in range(3):
                kept.new_step()
                for tag in range(2):
                    kept.send("F", 1, tag, payload((4, 3), torch.float32, 10 * step + tag))
                kept.wait_sends()
            kept_headers = len(counter.headers)
            kept.new_step()
            try:
                kept.send("F", 1, 0, payload((5, 3), torch.float32, 0))
                out["kept_refusal"] = None
            except ShapeError as e:
                out["kept_refusal"] = str(e)
            kept_headers_after_refusal = len(counter.headers)
            kept.new_step(renegotiate=True)  # as sampling after training does: other shapes
            kept.send("F", 1, 0, payload((5, 3), torch.float32, 7))
            kept.wait_sends()
            kept_headers_renegotiated = len(counter.headers)
        out.update(kept_headers=kept_headers, kept_headers_after_refusal=kept_headers_after_refusal,
                   kept_headers_renegotiated=kept_headers_renegotiated)
    else:
        kept_steps, posted_at_once = [], []
        for step in range(3):
            kept.new_step()
            pending = [kept.recv("F", 0, tag) for tag in range(2)]
            posted_at_once.append(pending[0].work is not None)
            kept_steps.append([r.wait() for r in pending])
        kept.new_step(renegotiate=True)
        out["kept_renegotiated"] = kept.recv("F", 0, 0).wait()
        out.update(kept_steps=kept_steps, kept_posted_at_once=posted_at_once)
    dist.barrier()

    # 6. refusals, last (a send that should have been refused is never received: nothing waits
    # for it, so a regression fails these checks only): within a step another shape or dtype;
    # in any step too many dimensions or an unsupported dtype
    p2p.new_step()
    if rank == 0:
        p2p.send("F", 1, 20, payload((4, 3), torch.float32, 20))
        p2p.wait_sends()
    else:
        out["before_refusals"] = p2p.recv("F", 0, 20).wait()
    errors, refused = [], []
    if rank == 0:
        for bad in (payload((4, 2), torch.float32, 0), payload((4, 3), torch.float64, 0)):
            try:
                p2p.send("F", 1, 21, bad)
                errors.append(None)
            except ShapeError as e:
                errors.append(str(e))
    for bad in (torch.zeros((1,) * 7), torch.zeros(3, dtype=torch.bool), torch.zeros(2, dtype=torch.complex64)):
        p2p.new_step()
        try:
            p2p.send("F", peer, 22, bad)
            refused.append(None)
        except ShapeError as e:
            refused.append(str(e))
    out.update(errors=errors, refused=refused)
    dist.barrier()
    return out


_RESULTS: dict = {}


def results(world_size: int):
    """One run per world size, shared by the tests (a failure is remembered, not rerun)."""
    if world_size not in _RESULTS:
        worker = {2: _two_rank_worker, 3: _three_rank_worker}[world_size]
        try:
            _RESULTS[world_size] = run_ranks(worker, world_size, timeout=60)
        except Exception as e:
            _RESULTS[world_size] = e
    if isinstance(_RESULTS[world_size], BaseException):
        raise _RESULTS[world_size]
    return _RESULTS[world_size]


def _assert_equal(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert torch.equal(actual, expected), f"{what}: values differ"


def test_every_dtype_and_dimension_arrives_intact():
    r0, r1 = results(2)
    cases = dtype_cases()
    assert {d for _, d in cases} == set(DTYPES) and {len(s) for s, _ in cases} == set(range(7))
    got = dict(r0["received"] + r1["received"])
    assert sorted(k for k in got if k != "transposed") == list(range(len(cases)))
    for i, (shape, dtype) in enumerate(cases):
        _assert_equal(got[i], payload(shape, dtype, i), f"message {i} ({dtype}, {len(shape)}-d)")
    _assert_equal(got["transposed"], payload((4, 3), torch.float32, 5).t().contiguous(), "non-contiguous tensor")


def test_header_once_per_step_stream_and_peer():
    r0, r1 = results(2)
    # 3 F messages and 2 B messages to one peer: one header per stream; a new step: one more
    assert r0["headers_in_step"] == 2, r0["header_dims"]
    assert r0["headers_total"] == 3, r0["header_dims"]
    assert [dims for _, dims in r0["header_dims"]] == [2, 2, 2]
    for tag in range(3):
        _assert_equal(r1["step1"][tag], payload((4, 3), torch.float32, tag), f"step 1 F {tag}")
    for tag in range(2):
        _assert_equal(r1["step1"][3 + tag], payload((2, 2), torch.int64, tag), f"step 1 B {tag}")
    _assert_equal(r1["step1"][5], payload((4, 3), torch.float32, 10), "step 1 F 10 (posted at once)")
    for i, tag in enumerate((3, 4)):
        _assert_equal(r1["step2"][i], payload((4, 2), torch.float32, tag), f"step 2 F {tag} (renegotiated)")
    assert r1["posted_at_once"], "a receive after the step's header was not posted at once"
    assert r1["deferred_after_new_step"], "new_step did not forget the negotiated shape on the receiver"


def test_kept_shapes_send_one_header_per_run():
    r0, r1 = results(2)
    assert r0["kept_headers"] == 1, "keep_shapes: a header after the first step"
    assert r1["kept_posted_at_once"] == [False, True, True], "a later step's first receive waited for a header"
    for step, got in enumerate(r1["kept_steps"]):
        for tag in range(2):
            _assert_equal(got[tag], payload((4, 3), torch.float32, 10 * step + tag), f"kept step {step} F {tag}")
    refusal = r0["kept_refusal"]
    assert refusal is not None and "(5, 3)" in refusal and "(4, 3)" in refusal and "first step" in refusal, refusal
    assert r0["kept_headers_after_refusal"] == 1, "a refused tensor sent a header"
    assert r0["kept_headers_renegotiated"] == 2, "new_step(renegotiate=True) sent no header"
    _assert_equal(r1["kept_renegotiated"], payload((5, 3), torch.float32, 7), "after renegotiating")


def test_shape_or_dtype_change_within_a_step_is_refused():
    r0, r1 = results(2)
    _assert_equal(r1["before_refusals"], payload((4, 3), torch.float32, 20), "the step's first message")
    other_shape, other_dtype = r0["errors"]
    assert other_shape is not None, "a message of another shape was sent within a step"
    assert other_dtype is not None, "a message of another dtype was sent within a step"
    assert "(4, 2)" in other_shape and "(4, 3)" in other_shape, other_shape
    assert "torch.float64" in other_dtype and "torch.float32" in other_dtype, other_dtype


def test_unsendable_tensors_are_refused():
    for r in results(2):
        too_many_dims, boolean, complex_ = r["refused"]
        assert too_many_dims is not None and "7-d" in too_many_dims, too_many_dims
        assert boolean is not None and "torch.bool" in boolean, boolean
        assert complex_ is not None and "complex" in complex_, complex_


def test_both_streams_in_flight_deliver_by_tag():
    r0, r1 = results(2)
    shapes = {"F": (3, 4), "B": (2, 5)}
    for rank, r in enumerate((r0, r1)):
        sender = 1 - rank
        assert len(r["streams"]) == 8
        for (stream, tag), t in r["streams"].items():
            expected = torch.full(shapes[stream], float(1000 * sender + 100 * (stream == "B") + tag))
            _assert_equal(t, expected, f"rank {rank} {stream}{tag} from rank {sender}")


def test_receive_posted_before_the_send():
    r0, r1 = results(2)
    _assert_equal(r1["early_first"], payload((3, 2), torch.float32, 0), "receive posted before the header")
    _assert_equal(r1["early_second"], payload((3, 2), torch.float32, 1), "payload receive posted before the send")
    _assert_equal(r1["waited"], payload((3, 2), torch.float32, 2), "wait before the send")
    assert r1["wait_called"] < r0["sent"], "setup: rank 1 did not wait before rank 0 sent"
    assert r1["wait_returned"] >= r0["sent"], "wait() returned before the tensor was sent"


# -- 3 ranks -------------------------------------------------------------------------------------------
def ring_value(stream: str, sender: int, tag: int, step: int) -> torch.Tensor:
    shape = (sender + 1 + step, 2 + step) if stream == "F" else (2 + step, sender + 2)
    return payload(shape, torch.float32 if step == 0 else torch.bfloat16, 10 * sender + tag + 50 * (stream == "B"))


def _three_rank_worker(rank: int, world_size: int) -> dict:
    topo = Topology.build(pp=3)
    p2p = P2P(topo)
    nxt, prv = (rank + 1) % 3, (rank - 1) % 3
    out: dict = {"ring": {}}
    # A ring, as the interleaved schedule runs it (the last rank hands on to the first): F to the
    # next rank, B to the previous, three messages each per step; two steps with other shapes
    # and dtypes. Receives are posted before the sends.
    for step in range(2):
        p2p.new_step()
        pending = {}
        for tag in range(3):
            pending[("F", tag)] = p2p.recv("F", prv, tag)
            pending[("B", tag)] = p2p.recv("B", nxt, tag)
        dist.barrier()
        for tag in range(3):
            p2p.send("F", nxt, tag, ring_value("F", rank, tag, step))
            p2p.send("B", prv, tag, ring_value("B", rank, tag, step))
        out["ring"][step] = {key: r.wait() for key, r in sorted(pending.items(), reverse=True)}
        p2p.wait_sends()
    # Rank 1 receives on one stream from two peers in one step, with a different shape from each:
    # the header is per peer.
    p2p.new_step()
    if rank == 1:
        from_two = {peer: [p2p.recv("F", peer, tag) for tag in range(2)] for peer in (2, 0)}
        out["from_two"] = {peer: [r.wait() for r in rs] for peer, rs in from_two.items()}
    else:
        for tag in range(2):
            p2p.send("F", 1, tag, payload((rank + 2, 3), torch.float32, rank + tag))
        p2p.wait_sends()
    dist.barrier()
    return out


def test_three_rank_ring_with_renegotiation():
    by_rank = results(3)
    for rank, r in enumerate(by_rank):
        nxt, prv = (rank + 1) % 3, (rank - 1) % 3
        for step in range(2):
            got = r["ring"][step]
            assert len(got) == 6
            for tag in range(3):
                _assert_equal(got[("F", tag)], ring_value("F", prv, tag, step), f"rank {rank} step {step} F{tag}")
                _assert_equal(got[("B", tag)], ring_value("B", nxt, tag, step), f"rank {rank} step {step} B{tag}")


def test_one_stream_from_two_peers_negotiates_per_peer():
    r1 = results(3)[1]
    for peer in (0, 2):
        for tag in range(2):
            _assert_equal(r1["from_two"][peer][tag], payload((peer + 2, 3), torch.float32, peer + tag),
                          f"F{tag} from rank {peer}")


# -- failure: a rank that dies -------------------------------------------------------------------------
# run_ranks kills every rank as soon as one exits with an error, and a rank that exits cleanly
# but never reports reads as a hang; so these scenarios run in processes started here. The
# parent waits for the surviving ranks' reports with its own deadline: a rank that hangs fails
# the test (and is killed), it cannot stall the suite. Where a peer dies, the collective timeout
# is set far beyond that wait, so an error that comes at all comes from the peer's death (a
# closed connection), however slowly a loaded machine runs; the waits are generous.
