"""Decode attention, store_kv and host metadata benchmark (same as ``kvplug bench attention``).

    python benchmarks/attention.py [--backends flashinfer,triton] [--out out.json] ...
"""

from __future__ import annotations

import argparse
import json

from kvplug.bench import attention


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    attention.add_arguments(parser)
    parser.add_argument("--out", metavar="FILE.json", help="also write the results as JSON to this file")
    parser.add_argument("--quick", action="store_true", help="small sizes: a fast smoke run")
    args = parser.parse_args()
    results = attention.run(args)
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(results, handle, indent=2)


if __name__ == "__main__":
    main()
