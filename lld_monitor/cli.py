"""The `lld-monitor` command. Each subcommand lives in `lld_monitor/commands/<name>.py` and exposes
`HELP` (one line), `add_arguments(parser)` and `run(args) -> int`; modules are imported only when
their subcommand runs, so `lld-monitor runs` never pays for torch."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

# subcommand -> module under lld_monitor.commands
COMMANDS: dict[str, str] = {
    "demo": "demo",
    "serve": "serve",
    "train": "train",
    "runs": "runs",
    "detect": "detect",
    "forecast": "forecast",
    "whatif": "whatif",
    "import-wandb": "import_wandb",
    "bench": "bench",
}


def _load(name: str):
    """The subcommand's module; a missing dependency stops the command with the package's name."""
    try:
        return importlib.import_module(f"lld_monitor.commands.{COMMANDS[name]}")
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.split(".")[0] == "lld_monitor":
            raise
        raise SystemExit(
            f"lld-monitor {name}: the package {exc.name!r} is missing; install the pinned dependencies with "
            "`pip install -r requirements.txt`"
        ) from exc


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lld-monitor",
        description="Watch GRPO runs of tool-using LLMs for the Lazy Likelihood Displacement death spiral.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        if only is not None and name != only:
            # keep the listing complete without importing every module
            sub.add_parser(name, add_help=False)
            continue
        module = _load(name)
        p = sub.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(only=command if command in COMMANDS else None)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if not args.verbose:
        # the detector logs each alert as it raises it; `detect` prints them all anyway, and for the
        # other commands (train, demo) warnings and critical alerts are enough on the console
        level = logging.ERROR if args.command == "detect" else logging.WARNING
        logging.getLogger("lld_monitor.detect").setLevel(level)
    if args.command is None:
        parser.print_help()
        return 2
    return int(_load(args.command).run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
