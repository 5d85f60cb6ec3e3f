"""python -m generator generate | check | list  [--spec variants.toml] [--out generated]"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .render import GENERATED, ROOT, GenerationError, diff_against, render_all, write_all
from .spec import SpecError, load_spec


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m generator", description="Generate permgen kernels from the spec.")
    parser.add_argument("command", choices=("generate", "check", "list"))
    parser.add_argument("--spec", type=Path, default=ROOT / "variants.toml", help="spec file (default: variants.toml)")
    parser.add_argument("--out", type=Path, default=GENERATED, help="output directory (default: generated/)")
    args = parser.parse_args(argv)
    try:
        variants = load_spec(args.spec)
        if args.command == "list":
            for v in variants:
                print(f"{v.name:40s} {' '.join(v.targets)}")
            return 0
        outputs = render_all(variants)
    except (SpecError, GenerationError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.command == "check":
        diff = diff_against(outputs, args.out)
        if diff:
            sys.stdout.write(diff)
            print("error: generated/ is out of date with the spec; run `make generate`", file=sys.stderr)
            return 1
        print(f"generated/ is up to date ({len(variants)} variants)")
        return 0
    written, removed = write_all(outputs, args.out)
    for path in written:
        print(f"wrote   generated/{path}")
    for path in removed:
        print(f"removed generated/{path}")
    print(f"{len(variants)} variants, {len(written)} files written, {len(removed)} removed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
