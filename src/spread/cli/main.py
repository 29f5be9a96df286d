"""The ``spread`` command: one entry point, one module per subcommand.

Each subcommand lives in its own module exposing ``register(subparsers)``; the module imports what it
needs only when it runs, so ``spread --help`` and ``spread run`` never pay for torch. To add a
subcommand (``bench``, ``plan``), write ``spread/cli/<name>.py`` and list it in ``_SUBCOMMANDS``.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from spread import __version__
from spread.cli._parser import SuggestingParser

_SUBCOMMANDS = ("spread.cli.run", "spread.cli.plan", "spread.cli.bench", "spread.cli.trace")

_DESCRIPTION = """\
spread: distributed training for PyTorch with tf.distribute-style strategies.

Write the training script once, with a strategy (spread.MultiWorkerMirroredStrategy() reads its
place in the job from the environment), then start it on every local CPU core or device with
`spread run`. The same script runs unchanged under torchrun or with TF_CONFIG on many machines."""

_EPILOG = """\
examples:
  spread run -n 4 train.py --epochs 3        4 processes of train.py on this machine
  spread run -n 2 -m mypkg.train             run a module instead of a script
  spread run --help                          every option of `run`, and the environment it sets

Exit status: that of the command; for `run`, the first failing rank's exit code."""


def build_parser() -> argparse.ArgumentParser:
    """The full ``spread`` parser, with every subcommand registered."""
    return _parsers()[0]


def _parsers() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """``spread``'s parser and each subcommand's, by name."""
    parser = SuggestingParser(
        prog="spread",
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"spread {__version__}")
    subparsers = parser.add_subparsers(
        dest="command", metavar="COMMAND", title="commands", parser_class=SuggestingParser
    )
    for name in _SUBCOMMANDS:
        importlib.import_module(name).register(subparsers)
    return parser, dict(subparsers.choices)


def _code(exc: SystemExit) -> int:
    if exc.code is None:
        return 0
    return exc.code if isinstance(exc.code, int) else 1


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``), run the subcommand, return the process exit status.

    Usage errors exit with status 2 (argparse's convention), after printing what was wrong.
    """
    parser, commands = _parsers()
    try:
        args, unknown = parser.parse_known_args(argv)
        if unknown:  # a subcommand's unknown options: its usage and its suggestion, not spread's
            commands.get(args.command, parser).error(f"unrecognized arguments: {' '.join(unknown)}")
        if args.command is None:
            parser.print_help(sys.stderr)
            return 2
        return int(args.handler(args))
    except SystemExit as exc:  # argparse's --help, --version and usage errors
        return _code(exc)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
