"""python -m benchmarks [--index | --check]: list the benchmarks, or write / check results/INDEX.md."""

from __future__ import annotations

import argparse
import sys

from benchmarks.catalog import INDEX, index, listing


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    ap.add_argument("--index", action="store_true", help=f"write {INDEX.relative_to(INDEX.parents[2])}")
    ap.add_argument("--check", action="store_true", help="exit 1 if the index is stale")
    args = ap.parse_args(argv)
    if args.index:
        INDEX.write_text(index())
        print(f"wrote {INDEX}")
    elif args.check:
        if not INDEX.exists() or INDEX.read_text() != index():
            print(f"{INDEX} is stale: run python -m benchmarks --index", file=sys.stderr)
            return 1
    else:
        print(listing())
    return 0


if __name__ == "__main__":
    sys.exit(main())
