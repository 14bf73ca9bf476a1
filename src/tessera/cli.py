"""Command line: ``tessera train --config FILE [--set section.key=value ...]``, ``tessera config``,
``tessera schedule --kind interleaved --pp 4 --vpp 2 --microbatches 8 [--out schedule.svg]``,
``tessera plan --config FILE --gpus N --gpu-memory 80GB``,
``tessera preprocess --input FILE.jsonl --tokenizer SPEC --output-prefix P``, ``tessera data inspect P``,
``tessera checkpoint inspect|export|import ...``, ``tessera generate|eval --checkpoint CKPT ...``.

Run it under ``torchrun --nproc-per-node N`` for several processes, or give ``--nproc-per-node N``
to ``tessera train`` (``generate``, ``eval``) itself: it checks the configuration for N processes (times ``--nnodes``)
first and then starts torchrun (training/launcher.py: rendezvous, restarts, preemption signals).
A bad configuration is refused on every rank before any work, with one line naming the key and
the fix (printed once, by rank 0) and exit status 2.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
import threading
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
    from tessera.training.launcher import add_launcher_arguments

    add_launcher_arguments(train, _positive)  # --nnodes, --node-rank, --rdzv-endpoint, --rdzv-id, --max-restarts
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
    plan = sub.add_parser("plan", help="the layouts that fit N GPUs, fastest first by a stated model, and why the "
                                       "others do not")
    plan.add_argument("--config", help="TOML file with [model], [train], ... sections")
    plan.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                      help="override one config value (repeatable)")
    plan.add_argument("--gpus", type=_positive(int), required=True, metavar="N", help="GPUs to lay the run out on")
    plan.add_argument("--gpu-memory", required=True, metavar="SIZE", help="memory per GPU, e.g. 80GB (GB = GiB)")
    plan.add_argument("--headroom", type=_positive(float, zero_ok=True), default=0.1,
                      help="fraction of the memory kept free for the CUDA context, NCCL and fragmentation (0.1)")
    plan.add_argument("--gpus-per-node", type=_positive(int), default=8, help="GPUs joined by NVLink (8)")
    plan.add_argument("--tflops", type=_positive(float), default=989.4, help="the GPU's dense peak, TFLOP/s (989.4)")
    plan.add_argument("--mfu", type=_positive(float), default=0.53, help="the fraction of the peak reached (0.53)")
    plan.add_argument("--node-bandwidth", type=_positive(float), default=300.0,
                      help="GB/s a collective reaches inside a node (300)")
    plan.add_argument("--network-bandwidth", type=_positive(float), default=40.0,
                      help="GB/s per GPU across nodes (40)")
    plan.add_argument("--hbm-bandwidth", type=_positive(float), default=3350.0, help="GB/s of GPU memory (3350)")
    plan.add_argument("--pcie-bandwidth", type=_positive(float), default=50.0,
                      help="GB/s each way between a GPU and host memory, for optimizer offload (50)")
    plan.add_argument("--host-bandwidth", type=_positive(float), default=77.0,
                      help="GB/s of host memory one GPU's offloaded AdamW reaches (77)")
    plan.add_argument("--host-ms", type=_positive(float, zero_ok=True), default=49.0,
                      help="ms the host takes to launch one micro-batch's forward and backward (49, eager layers)")
    plan.add_argument("--top", type=_positive(int), default=10, help="fitting layouts shown (10)")
    plan.add_argument("--all", action="store_true", help="list every layout that does not fit under its group")
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


def _plan(args: argparse.Namespace) -> int:
    """``tessera plan``: every layout of the config on --gpus GPUs, checked, sized and ranked."""
    from tessera.training.planner import Machine, no_fit, parse_memory, plan, render

    try:
        memory = parse_memory(args.gpu_memory)
        if not args.headroom < 1:
            raise ValueError(f"--headroom {args.headroom} leaves no memory: give a fraction below 1, e.g. 0.1")
        if not args.mfu <= 1:
            raise ValueError(f"--mfu {args.mfu} is above the GPU's peak: give a fraction, e.g. 0.4")
        machine = Machine(gpus=args.gpus, memory=memory, headroom=args.headroom, gpus_per_node=args.gpus_per_node,
                          peak_flops=args.tflops * 1e12, mfu=args.mfu, node_bandwidth=args.node_bandwidth * 1e9,
                          network_bandwidth=args.network_bandwidth * 1e9, hbm_bandwidth=args.hbm_bandwidth * 1e9,
                          pcie_bandwidth=args.pcie_bandwidth * 1e9, host_bandwidth=args.host_bandwidth * 1e9,
                          host_per_microbatch=args.host_ms / 1e3)
        base = load_config(args.config, args.overrides)
        verdicts = plan(base, machine)
    except ValueError as e:  # (ConfigError too)
        print(f"tessera: {e}", file=sys.stderr)
        return 2
    print(render(base, machine, verdicts, top=args.top, every=args.all))
    refusal = no_fit(verdicts, machine)
    if refusal:
        print(f"tessera: {refusal}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = _parser().parse_args(argv)
    if args.command == "config":
        from tessera.config.reference import reference_markdown

        print(reference_markdown())
        return 0
    if args.command == "schedule":
        return _schedule(args)
    if args.command == "plan":
        return _plan(args)
    if args.command in ("preprocess", "data"):
        from tessera.data.commands import run_data_command

        return run_data_command(args)
    if args.command == "checkpoint":
        from tessera.checkpoint.commands import run_checkpoint_command

        return run_checkpoint_command(args)
    from tessera.training.launch import shutdown, world_from_env
    from tessera.training.launcher import launch, launching, register_worker, say_status
    from tessera.training.preemption import StopRequest, job_started
    from tessera.training.rerun import NonFiniteStop

    rank, _, world = world_from_env()
    who = f"rank {rank}: " if world > 1 else ""
    interrupted = False
    stack = contextlib.ExitStack()
    try:
        if launching(args):  # --nproc-per-node, outside torchrun: this process starts it
            return launch(args, argv)
        # from here on SIGTERM and SIGUSR1 ask the run to finish its step, save and exit 0
        stop = StopRequest(started=job_started())
        if threading.current_thread() is threading.main_thread():
            stack.enter_context(stop.install())
        register_worker()  # (the launcher passes SIGTERM and SIGUSR1 on to this pid)
        if args.command in ("generate", "eval"):
            from tessera.inference.commands import run_inference_command

            return run_inference_command(args)
        cfg = load_config(args.config, args.overrides)
        from tessera.training.trainer import train

        train(cfg, stop=stop)
    except ConfigError as e:
        if e.rank_local:  # found in this rank's own share (of the data): only this rank knows
            print(f"tessera: {who}{e}", file=sys.stderr, flush=True)
        elif rank == 0:
            print(f"tessera: {e}", file=sys.stderr, flush=True)
        else:  # every rank finds the error; torchrun stops the others once one exits, so the
            time.sleep(3)  # rest leave rank 0 time to say it (seen lost on a loaded 2-core CI box)
        return say_status(rank, 2)
    except NonFiniteStop as e:  # every rank reached the same verdict (training/rerun.py): one says it
        if rank == 0:
            print(f"tessera: {e}", file=sys.stderr, flush=True)
        else:
            time.sleep(3)
        return say_status(rank, 3)
    except KeyboardInterrupt:  # Ctrl-C: one line, not a traceback from wherever the step was
        interrupted = True
        print(f"tessera: {who}interrupted", file=sys.stderr, flush=True)
        return say_status(rank, 130)
    finally:
        stack.close()
        if not interrupted:  # (after an interrupt, a collective may be half done: tearing the
            shutdown()       # process group down could wait for it; the process ends anyway)
    return 0


if __name__ == "__main__":
    sys.exit(main())
