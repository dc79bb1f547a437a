"""``kvplug bench SUITE [--out FILE.json] [--quick] [suite options]``: run a benchmark suite.

Suites are the modules of ``kvplug.bench`` that expose ``SUITE`` (see that package's docstring);
each becomes a sub-command with its own options plus the common ``--out`` and ``--quick``. A suite
with ``REQUIRES_CUDA = True`` is reported as skipped, with exit status 0, on a machine without CUDA.
The JSON written by ``--out`` is the suite's result, or ``{"suite", "skipped"}`` for a skipped suite.
"""

from __future__ import annotations

import argparse
import json
import re
import sys

from kvplug.bench import discover_suites


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("bench", help="run a benchmark suite (kvplug bench SUITE --help)")
    suites_parsers = parser.add_subparsers(dest="suite", metavar="SUITE")
    suites, failures = discover_suites()
    for name, module in sorted(suites.items()):
        description = plain_text(module.__doc__ or name)
        summary = description.strip().splitlines()[0]
        suite_parser = suites_parsers.add_parser(name, help=summary, description=description,
                                                 formatter_class=argparse.RawDescriptionHelpFormatter)
        suite_parser.add_argument("--out", metavar="FILE.json", help="also write the results as JSON to this file")
        suite_parser.add_argument("--quick", action="store_true", help="small sizes: a fast smoke run")
        if hasattr(module, "add_arguments"):
            module.add_arguments(suite_parser)
        suite_parser.set_defaults(suite_module=module)
    parser.set_defaults(handler=run, bench_parser=parser, suite_import_failures=failures)


def run(args: argparse.Namespace) -> int:
    module = getattr(args, "suite_module", None)
    if module is None:
        args.bench_parser.print_help()
        for failure in args.suite_import_failures:
            print(f"suite module {failure.module} failed to import: {failure.error!r}", file=sys.stderr)
        return 2
    if getattr(module, "REQUIRES_CUDA", False) and not _cuda_available():
        result = {"suite": module.SUITE, "skipped": "needs a CUDA device; none is available"}
        print(f"kvplug bench {module.SUITE}: skipped, it needs a CUDA device")
    else:
        result = module.run(args)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as handle:
            json.dump(result, handle, indent=2)
            handle.write("\n")
        print(f"wrote {args.out}")
    return 0


_LITERAL = re.compile(r"``([^`]+)``")


def plain_text(docstring: str) -> str:
    """A suite's docstring as terminal text: reST inline literals (double backquotes) lose their markup."""
    return _LITERAL.sub(r"\1", docstring)


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()
