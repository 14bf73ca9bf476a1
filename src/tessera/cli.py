"""Command line: ``tessera train --config FILE [--set section.key=value ...]``.

Run it under ``torchrun --nproc-per-node N`` for several processes. A bad configuration is
refused on every rank before any work, with one line naming the key and the fix (printed once,
by rank 0) and exit status 2.
"""

from __future__ import annotations

import argparse
import sys

from tessera.config import ConfigError, load_config


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tessera", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train a model (under torchrun for several processes)")
    train.add_argument("--config", help="TOML file with [model], [parallel], [train], ... sections")
    train.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                       help="override one config value (repeatable), e.g. --set parallel.tp=2")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from tessera.training.launch import shutdown, world_from_env

    rank = world_from_env()[0]
    try:
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
