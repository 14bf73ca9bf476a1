"""Pipeline schedules as data: a pure function gives each rank the ordered list of what it does.

``build_schedule(kind, pp, vpp, microbatches, rank)`` returns a list of :class:`Action`:
compute (``F`` forward, ``B`` full backward, ``I`` input-gradient backward, ``W`` weight-gradient
backward) and communication (``RECV_F``/``SEND_F`` activations, ``RECV_B``/``SEND_B`` gradients),
the vocabulary of ``torch.distributed.pipelining``. One executor runs any such list
(``executor.py``), and the same lists feed the simulator and the timeline picture
(``simulator.py``), so what is drawn is what runs.

Virtual stages: with ``vpp`` model chunks per rank, chunk ``c`` of rank ``r`` is virtual stage
``s = c * pp + r``; activations flow ``s -> s + 1`` (rank ``pp - 1`` hands chunk ``c`` on to rank 0's
chunk ``c + 1``).

Kinds:

- ``none``: gradient accumulation, F then B per micro-batch (pp = 1 only);
- ``gpipe``: all forwards, then all backwards (holds all m micro-batches' activations);
- ``1f1b``: ``pp - rank - 1`` warm-up forwards, then one forward / one backward, then the rest
  of the backwards: at most ``pp - rank`` micro-batches in flight;
- ``interleaved``: 1F1B over virtual stages (Megatron's order: rounds of ``pp`` micro-batches
  through every chunk), any number of micro-batches (a last, partial round is allowed);
- ``zb-h1``: zero-bubble H1 (Qi et al., 2023): backward split into I (input gradient, on the
  critical path back through the pipeline) and W (weight gradient, needed only by the optimizer
  step); rank r defers each W by r micro-batches, so the W's fill what would be bubbles, and
  holds at most ``pp`` micro-batches from F to W. With unit costs F = I = W and m >= pp the
  step takes ``3m + p - 1``: a bubble of ``(p - 1)(F + I - W)``, a third of 1F1B's;
- ``interleaved-zb``: the interleaved order with zero-bubble's split backward: each B becomes an
  I, and rank r runs the W of each I ``2r`` I's later (the rest after its last I), so the W's
  fill the drain's waits while the I's keep the critical path back. No rank holds more
  micro-batch chunks from F to W than interleaved's rank 0 holds activations (the later ranks
  hold more than under interleaved, as deferred W's, which keep only the linear layers' inputs
  and output gradients; counted in chunks, not bytes: with uneven layouts a later rank's chunk may
  be the larger). With unit costs it cuts interleaved's bubble to a third at small pp, less at
  m = pp for pp >= 3 and for pp >= 7, where a deferral of ``r`` would do better; ``2r`` is
  chosen for the per-stage costs measured on GPUs, where it beats interleaved and ZB-H1 in the
  simulator (BENCHMARKS.md, Pipeline parallelism).

Communication is overlapped: the receive a rank needs for its next compute is posted before its
current compute (Megatron's overlap_p2p_comm), so it arrives while the rank works.
"""

from __future__ import annotations

import functools
from collections import Counter
from dataclasses import dataclass
from enum import Enum


class Op(str, Enum):
    F = "F"
    B = "B"
    I = "I"  # noqa: E741 (the standard name: input-gradient part of backward)
    W = "W"
    RECV_F = "RECV_F"
    SEND_F = "SEND_F"
    RECV_B = "RECV_B"
    SEND_B = "SEND_B"

    def __str__(self) -> str:
        return self.value


COMPUTE = (Op.F, Op.B, Op.I, Op.W)
KINDS = ("none", "gpipe", "1f1b", "interleaved", "zb-h1", "interleaved-zb")
SPLIT_BACKWARD = ("zb-h1", "interleaved-zb")  # kinds that run I and W (deferred weight gradients)
INTERLEAVED = ("interleaved", "interleaved-zb")  # kinds over vpp >= 2 model chunks per rank


@dataclass(frozen=True)
class Action:
    op: Op
    microbatch: int
    chunk: int = 0
    peer: int | None = None  # pipeline rank on the other end of a send / receive

    def __str__(self) -> str:
        chunk = f".{self.chunk}" if self.chunk else ""
        peer = f"@{self.peer}" if self.peer is not None else ""
        return f"{self.op}{self.microbatch}{chunk}{peer}"


class ScheduleError(ValueError):
    """A schedule that cannot run with these sizes, said in words."""


# -- checks -------------------------------------------------------------------------------------
def check_kind(kind: str, pp: int, vpp: int, microbatches: int) -> None:
    if kind not in KINDS:
        raise ScheduleError(f"unknown schedule '{kind}': choose one of {', '.join(KINDS)}")
    if pp < 1 or vpp < 1:
        raise ScheduleError(f"pp and vpp must be >= 1, got pp={pp}, vpp={vpp}")
    if microbatches < 1:
        raise ScheduleError(f"a step needs at least one micro-batch, got {microbatches}")
    if vpp > 1 and pp < 2:
        raise ScheduleError("vpp > 1 needs pp >= 2")
    if kind == "none" and pp > 1:
        raise ScheduleError("schedule 'none' (no pipelining) needs pp=1: choose 1f1b, interleaved, zb-h1 "
                            "or interleaved-zb")
    if kind in INTERLEAVED and vpp < 2:
        raise ScheduleError(f"schedule '{kind}' needs vpp >= 2 model chunks per rank")
    if kind not in INTERLEAVED and vpp > 1:
        raise ScheduleError(f"schedule '{kind}' runs one model chunk per rank: use 'interleaved' or "
                            f"'interleaved-zb' for vpp={vpp}")


# -- compute orders ------------------------------------------------------------------------------
def _one_f_one_b(forwards: list[tuple[int, int]], backwards: list[tuple[int, int]], warmup: int,
                 backward_op: Op = Op.B) -> list[Action]:
    warmup = min(warmup, len(forwards))
    order = [Action(Op.F, mb, c) for mb, c in forwards[:warmup]]
    for (fmb, fc), (bmb, bc) in zip(forwards[warmup:], backwards):
        order += [Action(Op.F, fmb, fc), Action(backward_op, bmb, bc)]
    order += [Action(backward_op, mb, c) for mb, c in backwards[len(forwards) - warmup:]]
    return order


def _round_sizes(pp: int, m: int) -> list[int]:
    """Micro-batches per round: pp each when pp divides m (Megatron); otherwise m spread over
    m // pp rounds of at least pp (a short last round would run its micro-batches through the
    chunks one after another, leaving the other ranks idle)."""
    rounds = max(1, m // pp)
    base, extra = divmod(m, rounds)
    return [base + 1] * extra + [base] * (rounds - extra)


def _interleaved_sequence(pp: int, vpp: int, m: int, reverse_chunks: bool) -> list[tuple[int, int]]:
    """(micro-batch, chunk): each round of micro-batches goes through every chunk in turn."""
    out, start = [], 0
    for size in _round_sizes(pp, m):
        chunks = range(vpp - 1, -1, -1) if reverse_chunks else range(vpp)
        out += [(mb, c) for c in chunks for mb in range(start, start + size)]
        start += size
    return out


def _list_schedule(pp: int, vpp: int, forwards: list[tuple[int, int]], backwards: list[tuple[int, int]],
                   limits: list[int]) -> list[list[Action]]:
    """Per-rank orders by list scheduling on a unit-cost clock (F = 1, B = 2).

    Every rank walks the same forward and backward sequences of (micro-batch, chunk). A free
    rank takes, in priority order: the next backward whose gradient has arrived; the next
    forward whose input has arrived, while fewer than ``limits[rank]`` micro-batches hold
    activations (forward done, backward not). The result is deterministic, and as a completed
    simulation it cannot deadlock.
    """
    last = pp * vpp - 1
    cost = {Op.F: 1, Op.B: 2}
    done: dict[tuple, int] = {}  # (op, mb, stage) -> finish time
    nf, nb = [0] * pp, [0] * pp
    free = [0] * pp
    orders: list[list[Action]] = [[] for _ in range(pp)]
    total = len(forwards)

    def ready(key: tuple, t: int) -> bool:
        return done.get(key, t + 1) <= t

    t = 0
    while any(n < total for n in nb):
        progressed = any(f > t for f in free)
        for r in range(pp):
            if free[r] > t:
                continue
            choice = None
            if nb[r] < nf[r]:
                mb, c = backwards[nb[r]]
                stage = c * pp + r
                key = (Op.F, mb, stage) if stage == last else (Op.B, mb, stage + 1)
                if ready(key, t) and (Op.F, mb, stage) in done:
                    choice = (Op.B, mb, c)
            if choice is None and nf[r] < total and nf[r] - nb[r] < limits[r]:
                mb, c = forwards[nf[r]]
                stage = c * pp + r
                if stage == 0 or ready((Op.F, mb, stage - 1), t):
                    choice = (Op.F, mb, c)
            if choice is None:
                continue
            op, mb, c = choice
            (nf if op == Op.F else nb)[r] += 1
            orders[r].append(Action(op, mb, c))
            done[(op, mb, c * pp + r)] = t + cost[op]
            free[r] = t + cost[op]
            progressed = True
        if not progressed:
            raise ScheduleError(f"no valid order for pp={pp}, vpp={vpp} with {total // vpp} micro-batches")
        t += 1
    return orders


def compute_order(kind: str, pp: int, vpp: int, microbatches: int, rank: int) -> list[Action]:
    """The compute actions (F, B, I, W) of ``rank`` in the order it runs them."""
    check_kind(kind, pp, vpp, microbatches)
    if not 0 <= rank < pp:
        raise ScheduleError(f"pipeline rank {rank} is outside [0, pp={pp})")
    m = microbatches
    if kind == "none":
        return [Action(op, mb) for mb in range(m) for op in (Op.F, Op.B)]
    if kind == "gpipe":
        return [Action(Op.F, mb) for mb in range(m)] + [Action(Op.B, mb) for mb in range(m)]
    if kind == "1f1b":
        seq = [(mb, 0) for mb in range(m)]
        return _one_f_one_b(seq, seq, pp - rank - 1)
    if kind == "interleaved" and m % pp == 0:  # Megatron's fixed warm-up is exact for whole rounds
        forwards = _interleaved_sequence(pp, vpp, m, reverse_chunks=False)
        backwards = _interleaved_sequence(pp, vpp, m, reverse_chunks=True)
        return _one_f_one_b(forwards, backwards, (pp - rank - 1) * 2 + (vpp - 1) * pp)
    if kind == "zb-h1":
        return _zero_bubble_h1(pp, m, rank)
    if kind == "interleaved-zb":
        return _split_backward(compute_order("interleaved", pp, vpp, m, rank), 2 * rank)
    return list(_clocked_interleaved(pp, vpp, m)[rank])


def _split_backward(order: list[Action], defer: int) -> list[Action]:
    """``order`` with each B split into its I, and the W of each I run ``defer`` I's later (the
    rest after the last I). A W waits only for its own I, so this cannot deadlock an order
    that did not."""
    out: list[Action] = []
    pending: list[Action] = []  # I's whose W has not run
    for action in order:
        if action.op != Op.B:
            out.append(action)
            continue
        out.append(Action(Op.I, action.microbatch, action.chunk))
        pending.append(action)
        if len(pending) > defer:
            done = pending.pop(0)
            out.append(Action(Op.W, done.microbatch, done.chunk))
    return out + [Action(Op.W, a.microbatch, a.chunk) for a in pending]


def _zero_bubble(m: int, warmup: int, defer: int) -> list[Action]:
    """``warmup`` forwards, then for each micro-batch ``k`` its I, the W of micro-batch
    ``k - defer`` and the next forward, then the W's left."""
    warmup = min(warmup, m)
    order = [Action(Op.F, mb) for mb in range(warmup)]
    weights = 0
    for mb in range(m):
        order.append(Action(Op.I, mb))
        if mb >= defer:
            order.append(Action(Op.W, mb - defer))
            weights += 1
        if mb + warmup < m:
            order.append(Action(Op.F, mb + warmup))
    return order + [Action(Op.W, mb) for mb in range(weights, m)]


def _zero_bubble_h1(pp: int, m: int, rank: int) -> list[Action]:
    """ZB-H1 (Qi et al., 2023): ``pp - rank`` warm-up forwards; rank r defers each W by r
    micro-batches, so the I's, the pipeline's critical path back to rank 0, never wait behind a
    W on the later ranks, and the deferred W's fill the drain; every rank holds at most ``pp``
    micro-batches from F to W, 1F1B's bound on rank 0."""
    return _zero_bubble(m, pp - rank, rank)


@functools.lru_cache(maxsize=32)
def _clocked_interleaved(pp: int, vpp: int, m: int) -> tuple[tuple[Action, ...], ...]:
    """Every rank's order from one list-scheduling run (cached: build_all asks once per rank):
    interleaved with a partial last round (m % pp != 0), where Megatron's fixed warm-up can
    deadlock."""
    forwards = _interleaved_sequence(pp, vpp, m, reverse_chunks=False)
    backwards = _interleaved_sequence(pp, vpp, m, reverse_chunks=True)
    # Megatron's warm-up for rounds of this size, plus one (the 1F1B step's forward)
    warmup = [(pp - r - 1) * 2 + (vpp - 1) * max(_round_sizes(pp, m)) + 1 for r in range(pp)]
    for slack in range(pp * vpp + 1):  # widen only if that is too tight to make progress
        try:
            orders = _list_schedule(pp, vpp, forwards, backwards, [w + slack for w in warmup])
            break
        except ScheduleError:
            continue
    else:
        raise ScheduleError(f"no interleaved order found for pp={pp}, vpp={vpp}, {m} micro-batches")
    return tuple(tuple(order) for order in orders)


# -- communication -------------------------------------------------------------------------------
def _comms(action: Action, pp: int, vpp: int, rank: int) -> tuple[list[Action], list[Action]]:
    """(receives needed before, sends produced after) one compute action."""
    stage, last = action.chunk * pp + rank, pp * vpp - 1
    prev_rank, next_rank = (rank - 1) % pp, (rank + 1) % pp
    mb, c = action.microbatch, action.chunk
    if action.op == Op.F:
        recv = [Action(Op.RECV_F, mb, c, prev_rank)] if stage > 0 else []
        send = [Action(Op.SEND_F, mb, c, next_rank)] if stage < last else []
        return recv, send
    if action.op in (Op.B, Op.I):
        recv = [Action(Op.RECV_B, mb, c, next_rank)] if stage < last else []
        send = [Action(Op.SEND_B, mb, c, prev_rank)] if stage > 0 else []
        return recv, send
    return [], []


def build_schedule(kind: str, pp: int, vpp: int, microbatches: int, rank: int) -> list[Action]:
    """Compute and communication actions of ``rank``: each receive is posted one compute early
    (before the compute that precedes its consumer) and each send right after its producer."""
    order = compute_order(kind, pp, vpp, microbatches, rank)
    comms = [_comms(a, pp, vpp, rank) for a in order]
    actions: list[Action] = []
    posted: set[Action] = set()
    for k, action in enumerate(order):
        for recv in comms[k][0] + (comms[k + 1][0] if k + 1 < len(order) else []):
            if recv not in posted:
                posted.add(recv)
                actions.append(recv)
        actions.append(action)
        actions += comms[k][1]
    return actions


def build_all(kind: str, pp: int, vpp: int, microbatches: int) -> list[list[Action]]:
    return [build_schedule(kind, pp, vpp, microbatches, r) for r in range(pp)]


def check_matched(schedules: list[list[Action]]) -> None:
    """Every send has exactly one receive on its peer, and vice versa."""
    pp = len(schedules)
    expected: Counter = Counter()  # the receive each send needs, as (op, mb, chunk, src, dst)
    recvs: Counter = Counter()
    for rank, actions in enumerate(schedules):
        for a in actions:
            # What the sender calls chunk c arrives at the receiver as the neighbouring chunk.
            if a.op == Op.SEND_F:
                expected[(Op.RECV_F, a.microbatch, a.chunk + (rank == pp - 1), rank, a.peer)] += 1
            elif a.op == Op.SEND_B:
                expected[(Op.RECV_B, a.microbatch, a.chunk - (rank == 0), rank, a.peer)] += 1
            elif a.op in (Op.RECV_F, Op.RECV_B):
                recvs[(a.op, a.microbatch, a.chunk, a.peer, rank)] += 1

    def describe(items) -> list[str]:
        return [f"{op}{mb}.{c} from rank {src} on rank {dst}" for (op, mb, c, src, dst) in sorted(items)[:3]]

    if expected != recvs:
        raise ScheduleError(f"unmatched point-to-point: receives missing {describe(expected - recvs)}, "
                            f"receives with no send {describe(recvs - expected)}")
