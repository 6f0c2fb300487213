"""`python -m graphar COMMAND`: graphar's command line.

Each command is a module with `add_arguments(parser)` and `run(args) -> int` (the exit status).
"""

from __future__ import annotations

import argparse
import sys

from graphar import demo, doctor

# name, module, one-line summary for the list of commands
COMMANDS = (
    (
        "demo",
        demo,
        "compile a tensor-parallel MLP and a Ulysses attention block with backend='graphar', "
        "show each rewrite and its transport, check the outputs against eager",
    ),
    (
        "doctor",
        doctor,
        "say whether graphar's custom all-reduce and IPC all-to-all are on here, and if not, "
        "why: versions, CUDA library, GPUs, peer access, NVLink, allocator",
    ),
)


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(
        prog="python -m graphar",
        description="graphar: fast collectives for tensor- and sequence-parallel models under torch.compile.",
    )
    commands = top.add_subparsers(title="commands", dest="command", metavar="COMMAND")
    for name, module, summary in COMMANDS:
        command = commands.add_parser(
            name, help=summary, description=module.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
        )
        module.add_arguments(command)
        command.set_defaults(run=module.run)
    return top


def main(argv: list[str] | None = None) -> int:
    cli = parser()
    args = cli.parse_args(argv)
    if args.command is None:
        cli.print_help(sys.stderr)
        return 2
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
