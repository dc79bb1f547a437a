"""The ``kvplug`` command. Each sub-command is a module of this package exposing
``register(subparsers)``; modules are discovered, so adding a command touches no shared file."""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
from typing import Sequence

from kvplug._version import __version__
from kvplug.interface import KVPlugError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvplug", description="kvplug: the KV-cache subsystem of an LLM serving engine, as a plugin."
    )
    parser.add_argument("--version", action="version", version=f"kvplug {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_info in sorted(pkgutil.iter_modules(__path__), key=lambda info: info.name):
        if module_info.name.startswith("_"):
            continue
        importlib.import_module(f"{__name__}.{module_info.name}").register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return int(args.handler(args) or 0)
    except KVPlugError as error:
        print(f"kvplug {args.command}: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
