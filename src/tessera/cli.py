"""Command line: ``tessera train --config FILE [--set section.key=value ...]``, ``tessera config``,
``tessera schedule --kind interleaved --pp 4 --vpp 2 --microbatches 8 [--out schedule.svg]``,
``tessera preprocess --input FILE.jsonl --tokenizer SPEC --output-prefix P``, ``tessera data inspect P``,
``tessera checkpoint inspect|export|import ...``, ``tessera generate|eval --checkpoint CKPT ...``.

Run it under ``torchrun --nproc-per-node N`` for several processes, or give ``--nproc-per-node N``
to ``tessera train`` (``generate``, ``eval``) itself: it checks the configuration for N processes
first and then starts torchrun. A bad configuration is refused on every rank before any work, with one line naming
the key and the fix (printed once, by rank 0) and exit status 2.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import signal
import subprocess
import sys
import tempfile
import time

from tessera.config import ConfigError, load_config


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tessera", description=(
        "Train transformer language models with tensor, sequence, pipeline and data parallelism "
        "(tessera COMMAND --help for each command)."))
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train a model (under torchrun for several processes)")
    train.add_argument("--config", help="TOML file with [model], [parallel], [train], ... sections")
    train.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                       help="override one config value (repeatable), e.g. --set parallel.tp=2")
    train.add_argument("--nproc-per-node", type=_positive(int), default=0, metavar="N",
                       help="check the config for N processes, then launch them with torchrun")
    sub.add_parser("config", help="print the configuration reference (every key, default and meaning)")
    schedule = sub.add_parser("schedule", help="simulate a pipeline schedule: step time, bubble (idle / busy time), picture")
    schedule.add_argument("--kind", default="1f1b", help="none, gpipe, 1f1b, interleaved, zb-h1 or interleaved-zb")
    schedule.add_argument("--pp", type=_positive(int), default=4, help="pipeline ranks")
    schedule.add_argument("--vpp", type=_positive(int), default=1, help="model chunks per rank (interleaved, interleaved-zb)")
    schedule.add_argument("--microbatches", type=int, default=8, help="micro-batches per step")
    schedule.add_argument("--cost-f", type=_positive(float), default=1.0, help="forward time of one chunk")
    schedule.add_argument("--cost-b", type=_positive(float), default=2.0, help="full backward time of one chunk")
    schedule.add_argument("--cost-i", type=_positive(float), help="input-grad backward time (default: half of B)")
    schedule.add_argument("--cost-w", type=_positive(float), help="weight-grad backward time (default: half of B)")
    schedule.add_argument("--comm", type=_positive(float, zero_ok=True), default=0.0, help="latency of one send between ranks")
    schedule.add_argument("--stage-tp", type=_sizes_list, help="heterogeneous stages: each stage's tp, e.g. 2,1 "
                          "(with --stage-dp; --pp is their length): a stage's times scale by 1 / (tp * dp)")
    schedule.add_argument("--stage-dp", type=_sizes_list, help="heterogeneous stages: each stage's dp, e.g. 1,2")
    schedule.add_argument("--out", help="write the timeline picture here (.svg, or .png with matplotlib)")
    schedule.add_argument("--print-actions", action="store_true", help="print each rank's action list")
    from tessera.data.commands import add_data_commands

    add_data_commands(sub)  # preprocess, data inspect
    from tessera.checkpoint.commands import add_checkpoint_commands

    add_checkpoint_commands(sub)  # checkpoint inspect, export, import
    from tessera.inference.commands import add_inference_commands

    add_inference_commands(sub)  # generate, eval
    return parser


def _positive(kind: type, zero_ok: bool = False):
    """An argparse type: ``kind(text)``, refused unless a finite number > 0 (sizes and costs),
    or >= 0 with ``zero_ok`` (a send's latency)."""

    def parse(text: str):
        value = kind(text)
        if not ((0 <= value) if zero_ok else (0 < value)) or not value < math.inf:  # (NaN too)
            what = "an integer" if kind is int else "a finite number"
            raise argparse.ArgumentTypeError(f"must be {what} {'>=' if zero_ok else '>'} 0, got {text}")
        return value
    return parse


def _sizes_list(text: str) -> list[int]:
    """An argparse type: comma-separated sizes >= 1 (one per pipeline stage)."""
    try:
        sizes = [int(x) for x in text.split(",")]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"must be comma-separated sizes >= 1, one per stage, e.g. 2,1; got {text}")
    return sizes


def _schedule(args: argparse.Namespace) -> int:
    """Build, check and simulate one schedule; print one summary line; draw it if asked."""
    from tessera.pipeline_parallel.schedules import ScheduleError, build_all, check_matched
    from tessera.pipeline_parallel.simulator import Costs, analytic_bubble, simulate
    from tessera.pipeline_parallel.timeline import draw_timeline, summary

    half = args.cost_b / 2
    scale, grids = (), ""
    if args.stage_tp or args.stage_dp:
        if not (args.stage_tp and args.stage_dp and len(args.stage_tp) == len(args.stage_dp)):
            print("tessera: --stage-tp and --stage-dp give one size per stage each, e.g. --stage-tp 2,1 "
                  "--stage-dp 1,2", file=sys.stderr)
            return 2
        args.pp, scale = len(args.stage_tp), Costs.stage_scale(args.stage_tp, args.stage_dp)
        grids = f" stage_tp={','.join(map(str, args.stage_tp))} stage_dp={','.join(map(str, args.stage_dp))}"
    costs = Costs(F=args.cost_f, B=args.cost_b, I=args.cost_i or half, W=args.cost_w or half, comm=args.comm,
                  rank_scale=scale)
    try:
        schedules = build_all(args.kind, args.pp, args.vpp, args.microbatches)
        check_matched(schedules)
        timeline = simulate(schedules, args.vpp, costs)
        if args.out:  # a picture it cannot write is refused like a bad schedule: ValueError
            draw_timeline(timeline, args.out, title=summary(timeline, args.kind) + grids)
    except (ScheduleError, ValueError) as e:
        print(f"tessera: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a folder that does not exist, a directory, no permission
        print(f"tessera: cannot write the picture '{args.out}': {e.strerror or e}", file=sys.stderr)
        return 2
    if args.print_actions:
        for rank, actions in enumerate(schedules):
            print(f"rank {rank}: " + " ".join(map(str, actions)))
    # The textbook value assumes whole rounds of pp micro-batches (interleaved-zb has none).
    textbook = analytic_bubble(args.kind, args.pp, args.vpp, args.microbatches)
    analytic = f" (analytic {textbook:.3f})" if args.microbatches % args.pp == 0 and textbook is not None \
        and not grids else ""
    peaks = [timeline.peak_in_flight(r) for r in range(args.pp)]
    deferred = [timeline.peak_weight_grads_pending(r) for r in range(args.pp)]
    held = [timeline.peak_held(r) for r in range(args.pp)]  # F to W: what a split backward costs in memory
    print(f"{args.kind} pp={args.pp} vpp={args.vpp}{grids} microbatches={args.microbatches}: "
          f"step time {timeline.step_time:g}, bubble {timeline.bubble_fraction:.3f}{analytic}, "
          f"peak in-flight micro-batches per rank {peaks}"
          + (f", peak deferred weight gradients per rank {deferred}, peak held from F to W per rank {held}"
             if any(deferred) else "")
          + (f", picture {args.out}" if args.out else ""))
    return 0


def _launch(args: argparse.Namespace, argv: list[str]) -> int:
    """Check the configuration for the launch, then hand over to torchrun (which relaunches us
    with ``argv`` less ``--nproc-per-node``)."""
    if args.command == "train":
        from tessera.training.metrics import CHECKPOINT_LOCK_NAME, check_out_dir_free
        from tessera.training.preflight import check_runnable

        cfg = check_runnable(load_config(args.config, args.overrides), args.nproc_per_node)
        check_out_dir_free(cfg.train.out_dir)  # (the run takes the lock; said here once, before torchrun)
        if cfg.checkpoint.dir:
            check_out_dir_free(cfg.checkpoint.dir, "checkpoint.dir", CHECKPOINT_LOCK_NAME)
    else:  # generate, eval
        from tessera.inference.commands import check_request

        check_request(args, args.nproc_per_node)
    # --standalone: a rendezvous on a free local port, so two runs on one machine never collide
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", str(args.nproc_per_node), "-m", "tessera"] + _without_nproc(argv)
    with tempfile.TemporaryDirectory(prefix="tessera-exit-") as statuses:
        status = run_forwarding_signals(command, {EXIT_DIR: statuses})
        return worker_status(statuses, status)


def _without_nproc(argv: list[str]) -> list[str]:
    """The command line as given, less ``--nproc-per-node N`` (or ``=N``): what each worker runs."""
    out, skip = [], False
    for item in argv:
        if skip:
            skip = False
        elif item == "--nproc-per-node":
            skip = True
        elif not item.startswith("--nproc-per-node="):
            out.append(item)
    return out


EXIT_DIR = "TESSERA_EXIT_DIR"


def worker_status(folder: str, status: int) -> int:
    """torchrun's exit status is 1 whatever a worker's was: where workers ended on an error of
    ours, theirs (written under ``folder``, :func:`_say_status`), so a job script can tell a
    non-finite stop (3) or a configuration error (2) from a crash."""
    codes = set()
    for name in os.listdir(folder) if status else ():
        with contextlib.suppress(OSError, ValueError):
            codes.add(int(open(os.path.join(folder, name)).read()))
    return next((code for code in (3, 2, 130) if code in codes), status)


def _say_status(rank: int, code: int) -> int:
    """A worker started by ``tessera train --nproc-per-node`` leaves its exit status for the
    launcher (:func:`worker_status`); returns it."""
    folder = os.environ.get(EXIT_DIR)
    if folder:
        with contextlib.suppress(OSError):
            with open(os.path.join(folder, str(rank)), "w") as f:
                f.write(str(code))
    return code


STOPPING_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)


def _parent_death_signal():
    """A ``preexec_fn`` that asks Linux to send the child SIGTERM when its parent dies
    (``prctl(PR_SET_PDEATHSIG)``), or None elsewhere. libc is looked up here, before the fork."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl
    pr_set_pdeathsig = 1
    return lambda: prctl(pr_set_pdeathsig, int(signal.SIGTERM))


def run_forwarding_signals(command: list[str], extra_env: dict[str, str] | None = None) -> int:
    """Run ``command`` in a session of its own and return its exit status (128 + N where signal N
    ended it), passing on the signals that stop a job (SIGINT, SIGTERM, SIGHUP, SIGQUIT), each
    once. A job manager or ``kill`` that signals only the launcher would otherwise leave torchrun
    and its workers running on the GPUs. The session of its own keeps a terminal's Ctrl-C from
    reaching torchrun twice, directly and forwarded: a second signal interrupts torchrun's own
    shutdown of its workers. A signal this process ignores (``nohup``'s SIGHUP) is not passed on.
    On Linux the command also gets a SIGTERM when this process dies without passing anything on
    (SIGKILL, an out-of-memory kill): its parent-death signal."""
    child, early = None, []

    def forward(signum, _frame):
        if signum == signal.SIGINT:
            print("tessera: interrupted: stopping the workers", file=sys.stderr, flush=True)
        if child is None:  # (before the child exists: sent to it once it does)
            early.append(signum)
            return
        with contextlib.suppress(ProcessLookupError):
            child.send_signal(signum)
    previous = {sig: signal.signal(sig, forward) for sig in STOPPING_SIGNALS
                if signal.getsignal(sig) is not signal.SIG_IGN}
    try:
        # (torchrun sets OMP_NUM_THREADS=1 where it is unset, and prints a banner saying so)
        env = os.environ | ({} if "OMP_NUM_THREADS" in os.environ else {"OMP_NUM_THREADS": "1"}) | (extra_env or {})
        child = subprocess.Popen(command, start_new_session=True, env=env, preexec_fn=_parent_death_signal())
        for signum in early:
            child.send_signal(signum)
        status = child.wait()
        return status if status >= 0 else 128 - status
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = _parser().parse_args(argv)
    if args.command == "config":
        from tessera.config.reference import reference_markdown

        print(reference_markdown())
        return 0
    if args.command == "schedule":
        return _schedule(args)
    if args.command in ("preprocess", "data"):
        from tessera.data.commands import run_data_command

        return run_data_command(args)
    if args.command == "checkpoint":
        from tessera.checkpoint.commands import run_checkpoint_command

        return run_checkpoint_command(args)
    from tessera.training.launch import shutdown, world_from_env
    from tessera.training.rerun import NonFiniteStop

    rank, _, world = world_from_env()
    who = f"rank {rank}: " if world > 1 else ""
    interrupted = False
    try:
        if args.nproc_per_node and "LOCAL_RANK" not in os.environ:
            return _launch(args, argv)
        if args.command in ("generate", "eval"):
            from tessera.inference.commands import run_inference_command

            return run_inference_command(args)
        cfg = load_config(args.config, args.overrides)
        from tessera.training.trainer import train

        train(cfg)
    except ConfigError as e:
        if e.rank_local:  # found in this rank's own share (of the data): only this rank knows
            print(f"tessera: {who}{e}", file=sys.stderr, flush=True)
        elif rank == 0:
            print(f"tessera: {e}", file=sys.stderr, flush=True)
        else:  # every rank finds the error; torchrun stops the others once one exits, so the
            time.sleep(3)  # rest leave rank 0 time to say it (seen lost on a loaded 2-core CI box)
        return _say_status(rank, 2)
    except NonFiniteStop as e:  # every rank reached the same verdict (training/rerun.py): one says it
        if rank == 0:
            print(f"tessera: {e}", file=sys.stderr, flush=True)
        else:
            time.sleep(3)
        return _say_status(rank, 3)
    except KeyboardInterrupt:  # Ctrl-C: one line, not a traceback from wherever the step was
        interrupted = True
        print(f"tessera: {who}interrupted", file=sys.stderr, flush=True)
        return _say_status(rank, 130)
    finally:
        if not interrupted:  # (after an interrupt, a collective may be half done: tearing the
            shutdown()       # process group down could wait for it; the process ends anyway)
    return 0


if __name__ == "__main__":
    sys.exit(main())
