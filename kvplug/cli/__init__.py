"""The ``kvplug`` command. Each sub-command is a module of this package exposing
``register(subparsers)``; modules are discovered, so adding a command touches no shared file.

Only the command being run is imported (``kvplug plugins`` never imports ``serve``'s or
``bench``'s dependencies, ``kvplug --version`` imports no command at all); ``kvplug --help`` and
a mistyped command import them all, to list them.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
from typing import Iterable, Sequence

from kvplug._version import __version__


def command_names() -> list[str]:
    """The sub-commands: this package's public modules (found without importing them)."""
    return sorted(info.name for info in pkgutil.iter_modules(__path__) if not info.name.startswith("_"))


def build_parser(commands: Iterable[str] | None = None) -> argparse.ArgumentParser:
    """The ``kvplug`` parser with ``commands`` registered (every command by default)."""
    parser = argparse.ArgumentParser(
        prog="kvplug", description="kvplug: the KV-cache subsystem of an LLM serving engine, as a plugin."
    )
    parser.add_argument("--version", action="version", version=f"kvplug {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in command_names() if commands is None else commands:
        importlib.import_module(f"{__name__}.{name}").register(subparsers)
    return parser


def commands_to_register(argv: Sequence[str]) -> list[str] | None:
    """Which commands ``argv`` needs: the one it names, none for a bare ``--version``, else all."""
    positional = next((arg for arg in argv if not arg.startswith("-")), None)
    if positional in command_names():
        return [positional]
    if positional is None and "--version" in argv and not {"-h", "--help"} & set(argv):
        return []
    return None


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(commands_to_register(argv))
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        code = int(args.handler(args) or 0)
        sys.stdout.flush()  # inside the try: a closed pipe is seen here, not in the exit's flush
        return code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # the reader (`| head`) left: no traceback; stdout is pointed at /dev/null so that the
        # interpreter's final flush does not raise again
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, what a shell reports for a command killed by a closed pipe
    except Exception as error:
        # kvplug's own errors are one line; KVPlugError is looked up where it lives so that a
        # command that never imported the interface (and torch with it) does not import it here
        errors = sys.modules.get("kvplug.interface.errors")
        if errors is None or not isinstance(error, errors.KVPlugError):
            raise
        print(f"kvplug {args.command}: error: {error}", file=sys.stderr)
        return 2
