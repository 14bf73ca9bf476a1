"""Command line: ``tessera train --config FILE [--set section.key=value ...]``.

Run it under ``torchrun --nproc-per-node N`` for several processes, or give ``--nproc-per-node N``
to ``tessera train`` itself: it checks the configuration for N processes first and then starts
torchrun. A bad configuration is refused on every rank before any work, with one line naming
the key and the fix (printed once, by rank 0) and exit status 2.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from tessera.config import ConfigError, load_config


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tessera", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train a model (under torchrun for several processes)")
    train.add_argument("--config", help="TOML file with [model], [parallel], [train], ... sections")
    train.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                       help="override one config value (repeatable), e.g. --set parallel.tp=2")
    train.add_argument("--nproc-per-node", type=int, default=0, metavar="N",
                       help="check the config for N processes, then launch them with torchrun")
    sub.add_parser("config", help="print the configuration reference (every key, default and meaning)")
    return parser


def _launch(args: argparse.Namespace) -> int:
    """Check the configuration for the launch, then hand over to torchrun (which relaunches us)."""
    from tessera.training.trainer import check_runnable

    check_runnable(load_config(args.config, args.overrides), args.nproc_per_node)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.nproc_per_node),
               "-m", "tessera", "train"]
    command += ["--config", args.config] if args.config else []
    for item in args.overrides:
        command += ["--set", item]
    return subprocess.call(command)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "config":
        from tessera.config import reference_markdown

        print(reference_markdown())
        return 0
    from tessera.training.launch import shutdown, world_from_env

    rank = world_from_env()[0]
    try:
        if args.nproc_per_node and "LOCAL_RANK" not in os.environ:
            return _launch(args)
        cfg = load_config(args.config, args.overrides)
        from tessera.training.trainer import train

        train(cfg)
    except ConfigError as e:
        if rank == 0:
            print(f"tessera: {e}", file=sys.stderr, flush=True)
        return 2
    finally:
        shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
