"""``tessera train --nproc-per-node N``: the configuration checked for the whole world, then
torchrun started, its workers watched over.

- **Rendezvous.** One node: ``torchrun --standalone`` (a free local port: two runs on one
  machine never collide). Several (``--nnodes M --rdzv-endpoint HOST:PORT``, the same command
  on every node): torchrun's c10d rendezvous at that endpoint, under ``--rdzv-id`` (the job's
  name, alike on every node). c10d numbers the nodes itself; ``--node-rank 0`` only says which
  node hosts the rendezvous (the others join it), where torchrun would otherwise guess from the
  endpoint's host name.
- **Restarts.** ``--max-restarts K`` goes to torchrun: when a worker dies (a crash, SIGKILL, a
  lost machine), torchrun stops the others and starts them all again, up to K times, and the run
  resumes from ``checkpoint.dir``'s newest complete checkpoint. The out_dir and checkpoint.dir
  locks are ``flock``s, which the kernel releases with a dead process, and the workers' exit
  statuses are kept per attempt, so neither blocks a restart.
- **Signals.** SIGTERM and SIGUSR1 (a cluster's preemption or time-limit warning) mean "finish
  the step, save, exit 0" (training/preemption.py): the launcher passes them to every worker,
  found by the pid each registers here, including workers started after it (a restart). torchrun
  is started with both ignored and does not handle SIGTERM, so one sent to the whole job (Slurm
  signals every process of a job step) does not make torchrun kill its workers mid-save. SIGINT,
  SIGHUP and SIGQUIT still go to torchrun, which stops its workers (Ctrl-C: exit 130). Killed
  outright, the launcher stops torchrun through Linux's parent-death signal (SIGHUP).
- **Exit status.** torchrun says 1 whatever a worker's status was; the launcher returns the
  workers' own (3 non-finite stop, 2 configuration, 130 Ctrl-C) where they left one, from the
  last attempt.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time

from tessera.config import ConfigError, load_config

# (no torch at import: the parser of every command imports this module)
EXIT_DIR = "TESSERA_EXIT_DIR"  # the launcher's folder for the workers' pids and exit statuses
STOPPING_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)  # finish the step, save, exit 0 (training/preemption.py)
_DEFAULTS = {"nnodes": 1, "node_rank": None, "rdzv_endpoint": None, "rdzv_id": None, "max_restarts": 0}


def add_launcher_arguments(parser: argparse.ArgumentParser, positive) -> None:
    """The launch's options of ``tessera train`` (``positive``: cli's argparse type of numbers)."""
    parser.add_argument("--nnodes", type=positive(int), default=1, metavar="M",
                        help="nodes of the job, each running this same command (with --rdzv-endpoint)")
    parser.add_argument("--node-rank", type=positive(int, zero_ok=True), default=None, metavar="R",
                        help="this node's number, 0 to M-1 (e.g. $SLURM_NODEID): node 0 hosts the rendezvous")
    parser.add_argument("--rdzv-endpoint", metavar="HOST:PORT",
                        help="the rendezvous every node reaches (node 0's address and a free port)")
    parser.add_argument("--rdzv-id", metavar="ID", help="the job's name at the rendezvous, alike on every node "
                        "(e.g. $SLURM_JOB_ID; default: tessera)")
    parser.add_argument("--max-restarts", type=positive(int, zero_ok=True), default=0, metavar="K",
                        help="after a worker dies, restart the workers up to K times; they resume from "
                             "checkpoint.dir's newest checkpoint")


def launching(args: argparse.Namespace) -> bool:
    """Whether this process is the launcher (``--nproc-per-node`` outside torchrun); refuses the
    launch's options where there is no launch."""
    given = [name for name, default in _DEFAULTS.items() if getattr(args, name, default) != default]
    if args.nproc_per_node and "LOCAL_RANK" not in os.environ:
        return True
    if given:
        flag = "--" + given[0].replace("_", "-")
        under = "LOCAL_RANK" in os.environ
        raise ConfigError(flag, "is an option of tessera's own launch" + (", and this process runs under torchrun"
                                                                         if under else " (--nproc-per-node)"),
                          f"give it to torchrun instead ({flag})" if under else
                          f"add --nproc-per-node N (processes per node), or leave {flag} out")
    return False


def check_launch(args: argparse.Namespace) -> None:
    """The launch's options against each other, in words."""
    if args.nnodes > 1 and not args.rdzv_endpoint:
        raise ConfigError("--rdzv-endpoint", f"--nnodes {args.nnodes} needs a rendezvous that every node reaches",
                          "give --rdzv-endpoint HOST:PORT (node 0's address and a free port), the same on every node")
    if args.node_rank is not None and args.node_rank >= args.nnodes:
        raise ConfigError("--node-rank", f"{args.node_rank} is not below --nnodes {args.nnodes}",
                          f"give a node number from 0 to {args.nnodes - 1}")
    if args.rdzv_endpoint:
        host, _, port = args.rdzv_endpoint.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError("--rdzv-endpoint", f"{args.rdzv_endpoint!r} is not HOST:PORT",
                              "give node 0's address and a free port, e.g. node001:29500")


def torchrun_command(args: argparse.Namespace, argv: list[str] | None = None) -> list[str]:
    """The torchrun command line that relaunches ``tessera train`` on this node (``generate`` and
    ``eval``: their own command line ``argv``, less ``--nproc-per-node``)."""
    args = argparse.Namespace(**(_DEFAULTS | vars(args)))  # (generate and eval have no launch options)
    command = [sys.executable, "-m", "tessera.training.launcher"]  # torchrun, quiet where a worker said why (below)
    if args.nnodes == 1 and not args.rdzv_endpoint:
        command += ["--standalone"]
    else:
        command += ["--nnodes", str(args.nnodes), "--rdzv-backend", "c10d", "--rdzv-endpoint", args.rdzv_endpoint,
                    "--rdzv-id", args.rdzv_id or "tessera"]
        if args.node_rank is not None:
            command += ["--rdzv-conf", f"is_host={'true' if args.node_rank == 0 else 'false'}"]
    command += ["--nproc-per-node", str(args.nproc_per_node), "--max-restarts", str(args.max_restarts)]
    if _torchrun_takes_signals():  # (torch >= 2.7: leave SIGTERM to the workers)
        command += ["--signals-to-handle", "SIGINT,SIGHUP,SIGQUIT"]
    if args.command != "train":
        return command + ["-m", "tessera"] + _without_nproc(argv or [])
    command += ["-m", "tessera", "train"]
    command += ["--config", args.config] if args.config else []
    for item in args.overrides:
        command += ["--set", item]
    return command


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


def _torchrun_takes_signals() -> bool:
    from torch.distributed.launcher.api import LaunchConfig

    return "signals_to_handle" in getattr(LaunchConfig, "__dataclass_fields__", {})


def launch(args: argparse.Namespace, argv: list[str] | None = None) -> int:
    """Check the launch and the configuration for the whole world, then hand over to torchrun
    (which relaunches the command, ``argv``, in each worker); the workers' exit status."""
    from tessera.training.metrics import CHECKPOINT_LOCK_NAME, check_out_dir_free
    from tessera.training.preemption import JOB_START
    from tessera.training.preflight import check_runnable

    if args.command != "train":  # generate, eval: one node, no restarts (launching() refused the rest)
        from tessera.inference.commands import check_request

        check_request(args, args.nproc_per_node)
    else:
        check_launch(args)
        cfg = check_runnable(load_config(args.config, args.overrides), args.nproc_per_node * args.nnodes)
        check_out_dir_free(cfg.train.out_dir)  # (the run takes the lock; said here once, before torchrun)
        if cfg.checkpoint.dir and "://" not in cfg.checkpoint.dir:  # (an object store has no lock)
            check_out_dir_free(cfg.checkpoint.dir, "checkpoint.dir", CHECKPOINT_LOCK_NAME)
    with tempfile.TemporaryDirectory(prefix="tessera-exit-") as folder:
        # a restarted worker group must not read the last attempt's keys (its peers' old
        # addresses) from a store the rendezvous shares with it: pytorch/pytorch#135712
        env = {EXIT_DIR: folder, JOB_START: f"{time.time():.3f}", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
        status = run_forwarding_signals(torchrun_command(args, argv), env, workers=lambda child: worker_pids(folder, child),
                                        death_signal=signal.SIGHUP)
        return worker_status(folder, status)


# -- the workers' side ------------------------------------------------------------------------------
def register_worker() -> None:
    """A worker of ``tessera train --nproc-per-node`` leaves its pid for the launcher, which
    passes stop signals to it (one file per local rank: a restarted worker replaces its own)."""
    folder = os.environ.get(EXIT_DIR)
    if folder:
        with contextlib.suppress(OSError):
            path = os.path.join(folder, f"pid.{os.environ.get('LOCAL_RANK', 0)}")
            with open(path + ".tmp", "w") as f:
                f.write(str(os.getpid()))
            os.replace(path + ".tmp", path)


def say_status(rank: int, code: int) -> int:
    """A worker leaves its exit status for the launcher (:func:`worker_status`), per attempt (a
    restarted job's statuses are its own); returns it."""
    from tessera.training.launch import restart_count

    folder = os.environ.get(EXIT_DIR)
    if folder:
        with contextlib.suppress(OSError):
            with open(os.path.join(folder, f"status.{restart_count()}.{rank}"), "w") as f:
                f.write(str(code))
    return code


def worker_status(folder: str, status: int) -> int:
    """torchrun's exit status is 1 whatever a worker's was: where workers of the last attempt
    ended on an error of ours, theirs (:func:`say_status`), so a job script can tell a non-finite
    stop (3) or a configuration error (2) from a crash."""
    codes: dict[int, set[int]] = {}
    for name in os.listdir(folder) if status else ():
        parts = name.split(".")
        if len(parts) == 3 and parts[0] == "status" and parts[1].isdigit():
            with contextlib.suppress(OSError, ValueError):
                codes.setdefault(int(parts[1]), set()).add(int(open(os.path.join(folder, name)).read()))
    last = codes[max(codes)] if codes else set()
    return next((code for code in (3, 2, 130) if code in last), status)


def worker_pids(folder: str, parent: int) -> list[int]:
    """The pids the workers registered that are still children of ``parent`` (torchrun): a dead
    worker's pid, reused by another process, is never signalled."""
    pids = []
    for name in os.listdir(folder):
        if name.startswith("pid.") and not name.endswith(".tmp"):
            with contextlib.suppress(OSError, ValueError):
                pid = int(open(os.path.join(folder, name)).read())
                if _parent_of(pid) in (parent, None):
                    pids.append(pid)
    return pids


def _parent_of(pid: int) -> int | None:
    """``pid``'s parent (Linux's /proc), -1 where it is gone, None where this cannot be known."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except FileNotFoundError:
        return -1 if os.path.isdir("/proc/self") else None
    except (OSError, ValueError, IndexError):
        return None


# -- running torchrun -------------------------------------------------------------------------------
def _preexec(ignore: tuple, death_signal: int):
    """A ``preexec_fn``: ``ignore`` these signals, and (Linux) get ``death_signal`` when the
    parent dies (``prctl(PR_SET_PDEATHSIG)``). libc is looked up here, before the fork."""
    prctl = None
    if sys.platform.startswith("linux"):
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl

    def run() -> None:
        for sig in ignore:
            signal.signal(sig, signal.SIG_IGN)
        if prctl is not None:
            prctl(1, int(death_signal))  # PR_SET_PDEATHSIG
    return run


def run_forwarding_signals(command: list[str], extra_env: dict[str, str] | None = None, workers=None,
                           death_signal: int = signal.SIGTERM) -> int:
    """Run ``command`` in a session of its own and return its exit status (128 + N where signal N
    ended it), passing on the signals that stop a job (SIGINT, SIGTERM, SIGHUP, SIGQUIT), each
    once. A job manager or ``kill`` that signals only the launcher would otherwise leave torchrun
    and its workers running on the GPUs. The session of its own keeps a terminal's Ctrl-C from
    reaching torchrun twice, directly and forwarded: a second signal interrupts torchrun's own
    shutdown of its workers. A signal this process ignores (``nohup``'s SIGHUP) is not passed on.
    On Linux the command also gets ``death_signal`` when this process dies without passing
    anything on (SIGKILL, an out-of-memory kill).

    ``workers(child_pid)``: the pids to pass SIGTERM and SIGUSR1 to instead (torchrun's workers:
    the command then runs with both ignored); one that arrives before a worker registered, or
    while torchrun restarts them, reaches each worker as it appears."""
    child, early = None, []
    stop_signal: list[int] = []  # the first SIGTERM / SIGUSR1, once workers take them
    told: set[int] = set()

    def tell_workers() -> None:
        for pid in workers(child.pid) if stop_signal and child is not None else ():
            if pid not in told:
                told.add(pid)
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, stop_signal[0])

    def forward(signum, _frame):
        if signum == signal.SIGINT:
            print("tessera: interrupted: stopping the workers", file=sys.stderr, flush=True)
        if workers is not None and signum in STOP_SIGNALS:
            if not stop_signal:
                print(f"tessera: {signal.Signals(signum).name}: the workers finish their step, save and stop",
                      file=sys.stderr, flush=True)
                stop_signal.append(signum)
            tell_workers()
            return
        if child is None:  # (before the child exists: sent to it once it does)
            early.append(signum)
            return
        with contextlib.suppress(ProcessLookupError):
            child.send_signal(signum)
    handled = STOPPING_SIGNALS + ((signal.SIGUSR1,) if workers is not None else ())
    previous = {sig: signal.signal(sig, forward) for sig in handled if signal.getsignal(sig) is not signal.SIG_IGN}
    try:
        # (torchrun sets OMP_NUM_THREADS=1 where it is unset, and prints a banner saying so)
        env = os.environ | ({} if "OMP_NUM_THREADS" in os.environ else {"OMP_NUM_THREADS": "1"}) | (extra_env or {})
        ignore = STOP_SIGNALS if workers is not None else ()
        child = subprocess.Popen(command, start_new_session=True, env=env, preexec_fn=_preexec(ignore, death_signal))
        for signum in early:
            child.send_signal(signum)
        while True:
            try:
                status = child.wait(timeout=0.5 if workers is not None else None)
                break
            except subprocess.TimeoutExpired:
                tell_workers()  # (workers that registered since the signal)
        return status if status >= 0 else 128 - status
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def run_torchrun(argv: list[str]) -> int:
    """torchrun's main, less its traceback where the workers ended on an error of ours and each
    said it in one line already (:func:`say_status`); a crash keeps torchrun's report."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    try:
        run(parse_args(argv))
    except ChildFailedError:
        folder = os.environ.get(EXIT_DIR)
        if folder and worker_status(folder, 1) != 1:
            return 1  # (the launcher returns the workers' own status)
        raise
    return 0


if __name__ == "__main__":
    from torch.distributed.elastic.multiprocessing.errors import record

    sys.exit(record(run_torchrun)(sys.argv[1:]))


__all__ = ["add_launcher_arguments", "launching", "launch", "torchrun_command", "register_worker", "say_status",
           "worker_status", "worker_pids", "run_forwarding_signals", "EXIT_DIR"]
