"""Pipeline point-to-point when a peer fails: a rank that dies ends the ranks waiting on it with a
clear error within the collective timeout, never a silent hang, also down a pipeline of three; a
peer that never sends times out at the collective timeout. Run in processes this file starts
itself (``run_ranks`` kills every rank as soon as one exits, which is the event under test here)."""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
import queue
import time

import pytest
import torch
import torch.distributed as dist

from tessera.pipeline_parallel.p2p import P2P
from tessera.testing import free_port
from tessera.topology import Topology


def _mp_context():
    from tessera import testing

    make = getattr(testing, "_context", None)  # the harness's forkserver (torch already imported)
    return make() if make is not None else mp.get_context("forkserver")


def _attempt(fn) -> tuple[str, float]:
    start = time.monotonic()
    try:
        fn()
        return "no error", time.monotonic() - start
    except Exception as e:
        return f"{type(e).__name__}: {e}", time.monotonic() - start


def _report(q, rank: int, value) -> None:
    # plain pickle copies tensor data (the queue's pickler would share memory that dies with us)
    q.put((rank, pickle.dumps(value)))
    q.close()
    q.join_thread()  # flushed before the process may end abruptly


def _dies(rank: int, p2p: P2P, q) -> None:
    """2 ranks: rank 1 sends one message, then exits abruptly (no further sends)."""
    if rank == 1:
        p2p.send("F", 0, 0, torch.ones(3))
        p2p.wait_sends()
        dist.barrier()
        os._exit(1)
    first = p2p.recv("F", 1, 0).wait()
    second = p2p.recv("F", 1, 1)  # shape known: payload receive posted
    grad = p2p.recv("B", 1, 0)  # the step's first B message: header receive posted
    dist.barrier()
    out = {"first": first, "recv_posted": _attempt(second.wait), "recv_header": _attempt(grad.wait)}

    def send():
        p2p.send("F", 1, 1, torch.ones(1 << 16))
        p2p.wait_sends()

    out["send"] = _attempt(send)
    _report(q, rank, out)


def _cascade(rank: int, p2p: P2P, q) -> None:
    """3 ranks waiting for gradients down the pipeline: rank 2 dies, rank 1 fails and exits as
    a crashing rank would, rank 0 (waiting on rank 1) fails in turn."""
    if rank == 2:
        dist.barrier()
        os._exit(1)
    pending = p2p.recv("B", rank + 1, 0)
    dist.barrier()
    _report(q, rank, {"recv": _attempt(pending.wait)})
    if rank == 1:
        os._exit(1)


def _stuck(rank: int, p2p: P2P, q) -> None:
    """2 ranks: rank 1 is alive but never sends."""
    pending = p2p.recv("F", 1, 0) if rank == 0 else None
    dist.barrier()
    if rank == 1:
        time.sleep(120)  # killed by the parent
        os._exit(0)
    _report(q, rank, {"recv": _attempt(pending.wait)})


SCENARIOS = {"dies": _dies, "cascade": _cascade, "stuck": _stuck}


def _failure_worker(rank: int, world_size: int, port: int, pg_timeout: float, scenario: str, q) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        # the collective timeout, as tessera's launcher sets it from train.timeout_s
        dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=pg_timeout))
        p2p = P2P(Topology.build(pp=world_size, timeout=datetime.timedelta(seconds=pg_timeout)))
        dist.barrier()
        SCENARIOS[scenario](rank, p2p, q)
    except BaseException as e:  # a setup failure is reported, not mistaken for a hang
        _report(q, rank, {"setup": f"{type(e).__name__}: {e}"})
    os._exit(0)  # no process-group teardown with a dead peer


def run_failure(scenario: str, world_size: int, pg_timeout: float, reporting: list[int],
                wait: float) -> tuple[dict, str | None]:
    """Start ``world_size`` ranks on ``scenario``; the reports of ``reporting`` ranks, waiting at
    most ``wait`` seconds after they start, and a message naming the ranks that did not report
    in time (None if all did). Every process is killed at the end."""
    ctx = _mp_context()
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_failure_worker, args=(r, world_size, port, pg_timeout, scenario, q), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    reports: dict[int, dict] = {}
    deadline = time.monotonic() + wait
    try:
        while set(reporting) - set(reports) and time.monotonic() < deadline:
            try:
                rank, value = q.get(timeout=0.2)
            except queue.Empty:
                continue
            value = pickle.loads(value)
            assert "setup" not in value, f"{scenario}: rank {rank} failed before the scenario: {value['setup']}"
            reports[rank] = value
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=10)
    missing = sorted(set(reporting) - set(reports))
    hung = (f"{scenario}: ranks {missing} hung: no error within {wait:.0f}s "
            f"(collective timeout {pg_timeout:.0f}s)") if missing else None
    return reports, hung


def _assert_clear_error(attempt: tuple[str, float], what: str, words=("peer", "closed", "reset")) -> None:
    message, _ = attempt
    assert message != "no error", f"{what}: completed although the peer is gone"
    assert message.startswith("RuntimeError") or message.startswith("DistBackendError"), f"{what}: {message}"
    assert any(w in message.lower() for w in words), f"{what}: unclear: {message}"


# A dead peer's collective timeout: past the test's wait (and pytest's), so it never fires there.
DEAD_PEER_TIMEOUT, WAIT = 900.0, 120.0


def test_dead_rank_ends_the_waiting_rank_with_an_error():
    reports, hung = run_failure("dies", 2, DEAD_PEER_TIMEOUT, reporting=[0], wait=WAIT)
    assert hung is None, hung
    r0 = reports[0]
    assert torch.equal(r0["first"], torch.ones(3)), "the message sent before dying"
    for what in ("recv_posted", "recv_header", "send"):
        _assert_clear_error(r0[what], f"rank 0 {what} after rank 1 died")


def test_dead_rank_cascades_down_the_pipeline():
    reports, hung = run_failure("cascade", 3, DEAD_PEER_TIMEOUT, reporting=[0, 1], wait=WAIT)
    assert hung is None, hung
    _assert_clear_error(reports[1]["recv"], "rank 1 waiting on dead rank 2")
    _assert_clear_error(reports[0]["recv"], "rank 0 waiting on rank 1, which failed")


@pytest.mark.slow
def test_stuck_peer_times_out_at_the_collective_timeout():
    """A peer alive but silent: the receive ends in a timeout error, at the collective timeout
    (4 s: not early), not never."""
    timeout = 4.0
    reports, hung = run_failure("stuck", 2, timeout, reporting=[0], wait=timeout + WAIT)
    assert hung is None, hung
    _assert_clear_error(reports[0]["recv"], "rank 0 waiting on a peer that never sends", words=("timed out",))
    assert reports[0]["recv"][1] >= timeout / 2, reports[0]["recv"]
