"""Pipeline schedules: complete, matched, deadlock-free, as fast as the textbook, and drawn as simulated."""

import functools
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections import Counter

import pytest

from tessera import cli
from tessera.pipeline_parallel.schedules import (
    COMPUTE, KINDS, SPLIT_BACKWARD, Action, Op, ScheduleError, build_all, build_schedule, check_kind,
    check_matched)
from tessera.pipeline_parallel.simulator import Costs, analytic_bubble, simulate
from tessera.pipeline_parallel.timeline import draw_timeline

PPS, VPPS = (1, 2, 3, 4, 8), (1, 2, 3, 4)
# F : I : W per micro-batch and stage, measured on GPT-1.3B at pp=2 (BENCHMARKS.md, pipeline parallelism)
MEASURED_SPLIT = (1.0, 1.35, 0.65)


def _valid(kind, pp, vpp, m=1):
    try:
        check_kind(kind, pp, vpp, m)
        return True
    except ScheduleError:
        return False


LAYOUTS = [(kind, pp, vpp) for kind in KINDS for pp in PPS for vpp in VPPS if _valid(kind, pp, vpp)]


@functools.cache  # build_all of interleaved pp=8 is the slow part; several tests share it
def _built(kind, pp, vpp, m):
    return build_all(kind, pp, vpp, m)


def _compute(actions):
    return [a for a in actions if a.op in COMPUTE]


def _needed_recv(action, pp, vpp, rank):
    """The receive a compute action consumes, worked out here independently of schedules.py."""
    stage, last = action.chunk * pp + rank, pp * vpp - 1
    if action.op == Op.F and stage > 0:
        return Action(Op.RECV_F, action.microbatch, action.chunk, (rank - 1) % pp)
    if action.op in (Op.B, Op.I) and stage < last:
        return Action(Op.RECV_B, action.microbatch, action.chunk, (rank + 1) % pp)
    return None


def test_every_kind_has_layouts():
    # Guards the sweep below: a check_kind that refused everything would make it vacuous.
    assert Counter(kind for kind, _, _ in LAYOUTS) == {"none": 1, "gpipe": 5, "1f1b": 5, "interleaved": 12,
                                                       "zb-h1": 5, "interleaved-zb": 12}


@pytest.mark.parametrize("kind,pp,vpp", [(k, p, v) if p < 8 else pytest.param(k, p, v, marks=pytest.mark.slow)
                                          for k, p, v in LAYOUTS], ids=[f"{k}-pp{p}-vpp{v}" for k, p, v in LAYOUTS])
def test_schedule_is_complete_matched_and_runs(kind, pp, vpp):
    for m in range(1, 3 * pp + 3):
        schedules = _built(kind, pp, vpp, m)
        assert len(schedules) == pp
        check_matched(schedules)
        timeline = simulate(schedules, vpp)  # raises ScheduleError on a deadlock
        for rank, actions in enumerate(schedules):
            compute = _compute(actions)
            assert [a for a, _, _ in timeline.spans[rank]] == compute, (m, rank)
            ops = {(mb, c): [] for mb in range(m) for c in range(vpp)}
            for a in compute:
                ops[(a.microbatch, a.chunk)].append(a.op)  # a KeyError is a stray micro-batch or chunk
            # Each forward and its backward exactly once, in this order (I before W when split).
            expected = [Op.F, Op.I, Op.W] if kind in SPLIT_BACKWARD else [Op.F, Op.B]
            assert all(v == expected for v in ops.values()), (m, rank, ops)
            assert all(s < e for _, s, e in timeline.spans[rank])


@pytest.mark.parametrize("kind,pp,vpp", LAYOUTS, ids=[f"{k}-pp{p}-vpp{v}" for k, p, v in LAYOUTS])
def test_receive_is_posted_before_the_preceding_compute(kind, pp, vpp):
    for m in range(1, 3 * pp + 3):
        for rank, actions in enumerate(_built(kind, pp, vpp, m)):
            where = {a: i for i, a in enumerate(actions)}
            computes = [i for i, a in enumerate(actions) if a.op in COMPUTE]
            for k, i in enumerate(computes):
                recv = _needed_recv(actions[i], pp, vpp, rank)
                if recv is None:
                    continue
                assert recv in where, (m, rank, str(actions[i]))
                # Overlap: the receive is in flight while the previous compute runs.
                before = computes[k - 1] if k > 0 else i
                assert where[recv] < before, (m, rank, str(recv), str(actions[i]))


@pytest.mark.parametrize("kind,pp,vpp,m", [
    ("1f1b", 2, 1, 2), ("1f1b", 4, 1, 8), ("1f1b", 8, 1, 24), ("gpipe", 3, 1, 9), ("gpipe", 4, 1, 4),
    ("interleaved", 2, 2, 2), ("interleaved", 2, 2, 6), ("interleaved", 4, 2, 8), ("interleaved", 3, 3, 6),
    ("interleaved", 8, 4, 16), ("zb-h1", 2, 1, 4), ("zb-h1", 4, 1, 8), ("zb-h1", 8, 1, 16),
])
def test_bubble_matches_analytic(kind, pp, vpp, m):
    timeline = simulate(_built(kind, pp, vpp, m), vpp)
    assert timeline.bubble_fraction == pytest.approx(analytic_bubble(kind, pp, vpp, m))


def test_bubble_and_step_time_by_hand():
    # 1F1B: (m + p - 1)(F + B) = 11 * 3; interleaved p=4 v=2 m=8: (p - 1) / (v m) = 3 / 16.
    one_f_one_b = simulate(_built("1f1b", 4, 1, 8))
    assert one_f_one_b.step_time == 33 and one_f_one_b.bubble_fraction == pytest.approx(3 / 8)
    assert simulate(_built("interleaved", 4, 2, 8), 2).bubble_fraction == pytest.approx(3 / 16)
    # ZB-H1 p=4 m=6 (unit F, I, W): 3m + p - 1 = 21 against 18 busy, the paper's (p - 1)(F + I - W)
    zb = simulate(_built("zb-h1", 4, 1, 6))
    assert zb.step_time == 21 and zb.bubble_fraction == pytest.approx(3 / 18)
    # Latency adds to every hop of the fill and drain: 1F1B pp=2 m=1 is F, comm, F, B, comm, B.
    slow = simulate(_built("1f1b", 2, 1, 1), costs=Costs(F=1, B=2, comm=0.5))
    assert slow.step_time == pytest.approx(1 + 0.5 + 1 + 2 + 0.5 + 2)


@pytest.mark.parametrize("pp", [2, 3, 4, 8])
def test_peak_in_flight(pp):
    for m in range(1, 3 * pp + 3):
        for kind in ("1f1b", "zb-h1"):
            timeline = simulate(_built(kind, pp, 1, m))
            assert timeline.peak_in_flight(0) == min(m, pp) <= pp, (kind, m)
            assert all(timeline.peak_in_flight(r) <= pp - r for r in range(pp)), (kind, m)
            deferred = [timeline.peak_weight_grads_pending(r) for r in range(pp)]
            assert all(d <= (min(m, pp) if kind == "zb-h1" else 0) for d in deferred), (kind, m, deferred)
            # F to W (deferred W's hold their linear layers' inputs and output gradients): 1F1B's rank-0 bound
            assert max(timeline.peak_held(r) for r in range(pp)) <= min(m, pp), (kind, m)
        assert simulate(_built("gpipe", pp, 1, m)).peak_in_flight(0) == m
    for m in (pp, 2 * pp, 3 * pp):  # interleaved holds (micro-batch, chunk) pairs: Megatron's warm-up + 1
        timeline = simulate(_built("interleaved", pp, 2, m), 2)
        assert [timeline.peak_in_flight(r) for r in range(pp)] == [min(2 * m, 2 * (pp - r - 1) + pp + 1)
                                                                  for r in range(pp)], m


@pytest.mark.parametrize("pp", [2, 3, 4, 8])
def test_zero_bubble_beats_one_f_one_b(pp):
    for m in (1, pp, pp + 1, 2 * pp, 3 * pp + 2):
        zb = simulate(_built("zb-h1", pp, 1, m)).bubble_fraction
        assert zb < simulate(_built("1f1b", pp, 1, m)).bubble_fraction, m


@pytest.mark.parametrize("args,message", [
    (("interleaved", 4, 1, 8), "schedule 'interleaved' needs vpp >= 2 model chunks per rank"),
    (("interleaved", 1, 2, 8), "vpp > 1 needs pp >= 2"),
    (("none", 2, 1, 8), "schedule 'none' (no pipelining) needs pp=1"),
    (("1f1b", 4, 2, 8), "schedule '1f1b' runs one model chunk per rank: use 'interleaved' or 'interleaved-zb' for vpp=2"),
    (("interleaved-zb", 2, 1, 8), "schedule 'interleaved-zb' needs vpp >= 2 model chunks per rank"),
    (("pipedream", 4, 1, 8), "unknown schedule 'pipedream': choose one of none, gpipe, 1f1b, interleaved, zb-h1"),
    (("gpipe", 4, 1, 0), "a step needs at least one micro-batch, got 0"),
])
def test_check_kind_refuses(args, message):
    with pytest.raises(ScheduleError, match=re.escape(message)):
        check_kind(*args)
    with pytest.raises(ScheduleError, match=re.escape(message)):
        build_schedule(*args, rank=0)


@pytest.mark.parametrize("kind,vpp", [("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("gpipe", 1)])
@pytest.mark.parametrize("rank", [-1, 4])
def test_a_rank_outside_the_pipeline_is_refused(kind, vpp, rank):
    with pytest.raises(ScheduleError, match=re.escape(f"pipeline rank {rank} is outside [0, pp=4)")):
        build_schedule(kind, 4, vpp, 8, rank)


def test_crossed_orders_hang():
    f, b = (lambda mb: Action(Op.F, mb)), (lambda mb: Action(Op.B, mb))
    # Rank 0 waits for rank 1's B0 before its F1; rank 1 waits for that F1 before its B0.
    crossed = [[f(0), b(0), f(1), b(1)], [f(0), f(1), b(0), b(1)]]
    with pytest.raises(ScheduleError, match=r"hang.*0: 'B0'.*1: 'F1'"):
        simulate(crossed)
    assert simulate([[f(0), f(1), b(0), b(1)], [f(0), b(0), f(1), b(1)]]).step_time == 9  # uncrossed: fine


def test_check_matched_refuses_a_dropped_receive_or_send():
    schedules = _built("interleaved", 2, 2, 4)
    check_matched(schedules)
    # The hand-over from the last rank's chunk 0 to rank 0's chunk 1: the chunk renumbering path.
    wrap = Action(Op.RECV_F, 0, 1, 1)
    assert wrap in schedules[0]
    with pytest.raises(ScheduleError, match="unmatched point-to-point"):
        check_matched([[a for a in schedules[0] if a != wrap], schedules[1]])
    send = Action(Op.SEND_B, 2, 0, 0)
    assert send in schedules[1]
    with pytest.raises(ScheduleError, match="unmatched point-to-point"):
        check_matched([schedules[0], [a for a in schedules[1] if a != send]])


# -- the picture and the command line --------------------------------------------------------------
def _rects(svg_path):
    root = ET.parse(svg_path).getroot()
    ns = "{http://www.w3.org/2000/svg}"
    rects = [r for r in root.iter(ns + "rect") if r.get("class") in {op.value for op in COMPUTE}]
    labels = [t.text for t in root.iter(ns + "text") if t.get("class") == "microbatch"]
    return rects, labels, [t.text for t in root.iter(ns + "text")]


def test_svg_places_every_action_at_its_simulated_time(tmp_path):
    timeline = simulate(_built("zb-h1", 3, 1, 5), costs=Costs(F=1, B=2, I=1.5, W=0.5, comm=0.25))
    path = tmp_path / "zb.svg"
    draw_timeline(timeline, path, title="zero bubble & friends")
    rects, labels, texts = _rects(path)
    spans = [span for rank in timeline.spans for span in rank]
    assert len(rects) == len(spans) == 3 * 5 * 3
    (_, s0, _), x0 = spans[0], float(rects[0].get("x"))
    scale = float(rects[0].get("width")) / (spans[0][2] - spans[0][1])
    for rect, (action, start, end) in zip(rects, spans):
        assert rect.get("class") == action.op.value
        assert float(rect.get("x")) == pytest.approx(x0 + (start - s0) * scale, abs=0.1)
        assert float(rect.get("width")) == pytest.approx((end - start) * scale, abs=0.1)
    ys = sorted({float(r.get("y")) for r in rects})
    assert len(ys) == 3  # one row per rank
    fills = {op: {r.get("fill") for r in rects if r.get("class") == op} for op in "FIW"}
    assert all(len(f) == 1 for f in fills.values()) and len(set.union(*fills.values())) == 3
    assert labels == [str(a.microbatch) for a, _, _ in spans]  # one label per box, in its box's order
    assert "zero bubble &amp; friends" in path.read_text()  # escaped, and the file still parses


def test_cli_prints_one_line_with_the_bubble(capsys):
    assert cli.main(["schedule", "--kind", "1f1b", "--pp", "4", "--microbatches", "8"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out == ["1f1b pp=4 vpp=1 microbatches=8: step time 33, bubble 0.375 (analytic 0.375), "
                   "peak in-flight micro-batches per rank [4, 3, 2, 1]"]
    # Not a whole number of rounds: no analytic value; costs and latency change the step time.
    assert cli.main(["schedule", "--kind", "zb-h1", "--pp", "2", "--microbatches", "3",
                     "--cost-f", "2", "--cost-b", "4", "--comm", "1"]) == 0
    line = capsys.readouterr().out
    assert "analytic" not in line and "step time" in line
    expected = simulate(_built("zb-h1", 2, 1, 3), costs=Costs(F=2, B=4, I=2, W=2, comm=1))
    assert f"step time {expected.step_time:g}, bubble {expected.bubble_fraction:.3f}" in line
    assert cli.main(["schedule", "--kind", "zb-h1", "--pp", "2", "--microbatches", "8"]) == 0
    assert capsys.readouterr().out.strip() == (
        "zb-h1 pp=2 vpp=1 microbatches=8: step time 25, bubble 0.042 (analytic 0.042), "
        "peak in-flight micro-batches per rank [2, 1], peak deferred weight gradients per rank [1, 2], "
        "peak held from F to W per rank [2, 2]")


def test_cli_writes_the_svg(tmp_path, capsys):
    out = tmp_path / "schedule.svg"
    argv = ["schedule", "--kind", "interleaved", "--pp", "4", "--vpp", "2", "--microbatches", "8", "--out", str(out)]
    assert cli.main(argv) == 0
    assert "bubble 0.188 (analytic 0.188)" in capsys.readouterr().out
    rects, labels, texts = _rects(out)
    assert len(rects) == 4 * 2 * 8 * 2  # ranks x chunks x micro-batches x (F, B)
    assert Counter(labels) == {str(mb): 4 * 2 * 2 for mb in range(8)}
    assert "interleaved pp=4 vpp=2 microbatches=8 bubble=0.188" in texts
    # Two shades per kind of action: one per model chunk.
    assert len({r.get("fill") for r in rects if r.get("class") == "F"}) == 2


def test_cli_prints_actions(capsys):
    assert cli.main(["schedule", "--kind", "1f1b", "--pp", "2", "--microbatches", "3", "--print-actions"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[:2] == [f"rank {r}: " + " ".join(map(str, build_schedule("1f1b", 2, 1, 3, r))) for r in (0, 1)]
    assert lines[0] == "rank 0: F0 SEND_F0@1 RECV_B0@1 F1 SEND_F1@1 B0 RECV_B1@1 F2 SEND_F2@1 RECV_B2@1 B1 B2"


@pytest.mark.parametrize("argv", [
    ["--kind", "pipedream"], ["--kind", "interleaved", "--vpp", "1"], ["--kind", "none", "--pp", "2"],
    ["--microbatches", "0"], ["--out", "schedule.pdf"],
])
def test_cli_refuses_in_one_line(argv, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["schedule", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert len(captured.err.splitlines()) == 1 and captured.err.startswith("tessera: ")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("argv,problem", [
    (["--comm", "-5"], "argument --comm: must be a finite number >= 0, got -5"),
    (["--comm", "nan"], "argument --comm: must be a finite number >= 0, got nan"),
    (["--cost-b", "nan"], "argument --cost-b: must be a finite number > 0, got nan"),
    (["--cost-f", "inf", "--out", "t.svg"], "argument --cost-f: must be a finite number > 0, got inf"),
    (["--cost-w", "0"], "argument --cost-w: must be a finite number > 0, got 0"),
    (["--pp", "0"], "argument --pp: must be an integer > 0, got 0"),
])
def test_cli_refuses_costs_that_are_not_times(argv, problem, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:  # argparse: usage, then the error
        cli.main(["schedule", *argv])
    assert e.value.code == 2 and capsys.readouterr().err.splitlines()[-1].endswith(problem)
    assert list(tmp_path.iterdir()) == []


def test_png_without_matplotlib_says_what_to_do(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes any matplotlib import fail
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    timeline = simulate(_built("1f1b", 2, 1, 2))
    with pytest.raises(ValueError, match=r"matplotlib.*\.svg|\.svg.*matplotlib"):
        draw_timeline(timeline, tmp_path / "t.png")
    assert cli.main(["schedule", "--pp", "2", "--out", str(tmp_path / "t.png")]) == 2
    assert capsys.readouterr().err.startswith("tessera: cannot draw")


@pytest.mark.slow
def test_python_dash_m(tmp_path, capsys):
    """python -m tessera runs cli.main and exits with its status (the output in this process;
    the exit status and stderr through the interpreter)."""
    assert cli.main(["schedule", "--kind", "gpipe", "--pp", "2", "--microbatches", "4"]) == 0
    assert capsys.readouterr().out.startswith("gpipe pp=2 vpp=1 microbatches=4: step time 15, bubble 0.250 (analytic 0.250)")
    bad = subprocess.run([sys.executable, "-m", "tessera", "schedule", "--kind", "none", "--pp", "2"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and bad.stderr == "tessera: schedule 'none' (no pipelining) needs pp=1: " \
                                                 "choose 1f1b, interleaved, zb-h1 or interleaved-zb\n"


def test_png_picture_from_the_cli(tmp_path, capsys):
    # The issue's own example: interleaved pp=4 vpp=2 with 8 micro-batches, drawn as PNG.
    out = tmp_path / "schedule.png"
    assert cli.main(["schedule", "--kind", "interleaved", "--pp", "4", "--vpp", "2", "--microbatches", "8",
                     "--out", str(out)]) == 0
    assert "bubble 0.188 (analytic 0.188)" in capsys.readouterr().out
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


@pytest.mark.slow
def test_png_width_does_not_follow_the_costs_unit(tmp_path):
    """The same schedule with costs in seconds or in tenths of milliseconds: one picture size."""
    import struct

    sizes = []
    for scale in (0.012, 120.0):
        timeline = simulate(_built("1f1b", 4, 1, 32), costs=Costs(F=scale, B=2 * scale))
        draw_timeline(timeline, tmp_path / f"t{scale}.png")
        sizes.append(struct.unpack(">II", (tmp_path / f"t{scale}.png").read_bytes()[16:24]))  # IHDR width, height
    assert sizes[0] == sizes[1] and sizes[0][0] < 20_000


@pytest.mark.parametrize("name,value", [("F", 0), ("B", float("nan")), ("W", float("inf")), ("comm", -1.0)])
def test_costs_refuse_what_is_not_a_time(name, value):
    with pytest.raises(ValueError, match=f"Costs.{name} must be a finite time"):
        Costs(**{name: value})


@pytest.mark.parametrize("pp", [2, 3, 4, 8])
def test_zero_bubble_h1_reaches_the_papers_step_time(pp):
    """With unit F, I, W and at least pp micro-batches, ZB-H1 takes 3m + p - 1: a bubble of
    (p - 1)(F + I - W), a third of 1F1B's (Qi et al., 2023), holding at most pp micro-batches
    from F to W on any rank (1F1B's bound on rank 0)."""
    for m in range(pp, 3 * pp + 2):
        timeline = simulate(_built("zb-h1", pp, 1, m))
        assert timeline.step_time == 3 * m + pp - 1, m
        assert max(timeline.peak_held(r) for r in range(pp)) <= pp, m


def test_interleaved_zb_splits_interleaved_and_is_shorter():
    """interleaved-zb is interleaved's order with each B split into I and W (the I's where the
    B's were), rank r running each W 2r I's later; at the measured split it is shorter than
    interleaved and ZB-H1 at pp=2 with 8 micro-batches, and never longer than interleaved at
    the sizes swept, while no rank holds more micro-batch chunks from F to W than interleaved's
    first rank holds activations (later ranks hold more than they did, as deferred W's)."""
    f, i, w = MEASURED_SPLIT
    for pp, vpp in ((2, 2), (2, 3), (3, 2), (4, 2), (8, 2)):
        for m in range(1, 3 * pp + 3):
            base, split = _built("interleaved", pp, vpp, m), _built("interleaved-zb", pp, vpp, m)
            for r in range(pp):
                expected, waiting = [], []  # the W of the k-th I right after the (k + 2r)-th I
                for a in _compute(base[r]):
                    if a.op != Op.B:
                        expected.append(a)
                        continue
                    expected.append(Action(Op.I, a.microbatch, a.chunk))
                    waiting.append(a)
                    if len(waiting) > 2 * r:
                        done = waiting.pop(0)
                        expected.append(Action(Op.W, done.microbatch, done.chunk))
                expected += [Action(Op.W, a.microbatch, a.chunk) for a in waiting]
                assert _compute(split[r]) == expected, (pp, vpp, m, r)
            for vcosts in (Costs(F=f / vpp, B=(i + w) / vpp, I=i / vpp, W=w / vpp),):
                t_base, t_split = simulate(base, vpp, costs=vcosts), simulate(split, vpp, costs=vcosts)
                assert t_split.step_time <= t_base.step_time + 1e-9, (pp, vpp, m)
                most = max(t_base.peak_in_flight(r) for r in range(pp))  # rank 0's, interleaved
                assert max(t_split.peak_held(r) for r in range(pp)) <= most, (pp, vpp, m)
    per_chunk = Costs(F=f / 2, B=(i + w) / 2, I=i / 2, W=w / 2)
    split, base = (simulate(_built(k, 2, 2, 8), 2, costs=per_chunk).step_time for k in ("interleaved-zb", "interleaved"))
    h1 = simulate(_built("zb-h1", 2, 1, 8), costs=Costs(F=f, B=i + w, I=i, W=w)).step_time
    assert split < base - 0.5 and split < h1 - 0.5, (split, base, h1)  # 24.5 against 25.5 and 25.7 units (no transfer cost)


@pytest.mark.parametrize("where", ["missing/schedule.svg", "folder.svg", "missing/schedule.png"])
def test_cli_picture_it_cannot_write_is_refused_in_one_line(where, tmp_path, capsys, monkeypatch):
    """--out in a folder that does not exist, or naming a directory: one line and status 2, not
    a traceback."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "folder.svg").mkdir()
    assert cli.main(["schedule", "--pp", "2", "--out", where]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and len(captured.err.splitlines()) == 1
    assert captured.err.startswith(f"tessera: cannot write the picture '{where}'")
