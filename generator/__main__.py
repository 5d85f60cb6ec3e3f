"""python -m generator generate | check | list  [--spec variants.toml] [--out generated]
   python -m generator vendor <variant> -o FILE   (one self-contained Triton file)"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .render import (GENERATED, MARKER, ROOT, GenerationError, diff_against, out_of_date, render_all,
                     stale_and_foreign, write_all)
from .spec import SpecError, load_spec
from .vendor import vendor


def display_name(out_dir: Path) -> str:
    """How messages name the output directory: relative to the working directory when it lies
    below it, else by its own name (no machine paths in the output)."""
    resolved = out_dir.resolve()
    try:
        rel = resolved.relative_to(Path.cwd().resolve())
    except ValueError:
        return resolved.name or str(resolved)
    return rel.as_posix() if rel.parts else "."


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m generator", description="Generate permgen kernels from the spec.")
    parser.add_argument("command", choices=("generate", "check", "list", "vendor"))
    parser.add_argument("variant", nargs="?", help="vendor: the variant to write as one file")
    parser.add_argument("-o", "--output", type=Path, help="vendor: the file to write")
    parser.add_argument("--spec", type=Path, default=ROOT / "variants.toml", help="spec file (default: variants.toml)")
    parser.add_argument("--out", type=Path, default=GENERATED, help="output directory (default: generated/)")
    args = parser.parse_args(argv)
    label = display_name(args.out)
    try:
        variants = load_spec(args.spec)
        if args.command == "list":
            for v in variants:
                print(f"{v.name:40s} {' '.join(v.targets)}")
            return 0
        outputs = render_all(variants)
        if args.command == "vendor":
            return _vendor(args, parser, outputs)
    except (SpecError, GenerationError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.command == "check":
        changed = out_of_date(outputs, args.out)
        if changed:  # the files first, then the diff that explains them, then what to do
            listing = "".join(f"\n  {label}/{path}: {why}" for path, why in changed)
            files = f"{len(changed)} file" + ("s" if len(changed) > 1 else "")
            print(f"{label}/ is out of date with the spec ({files}):{listing}\n", file=sys.stderr, flush=True)
            sys.stdout.write(diff_against(outputs, args.out, label))
            sys.stdout.flush()
            print(f"error: {label}/ is out of date with the spec; run `make generate`", file=sys.stderr)
            return 1
        print(f"{label}/ is up to date ({len(variants)} variants)")
        return 0
    _, foreign = stale_and_foreign(outputs, args.out)
    if foreign:  # never delete or overwrite around files the generator did not write
        listing = "".join(f"\n  {label}/{path}" for path in foreign)
        print(f"error: {label}/ holds files that are not generator output (their first line does not "
              f"start with {MARKER!r}); move them out of {label}/ and run again:{listing}", file=sys.stderr)
        return 2
    try:
        written, removed = write_all(outputs, args.out)
    except (GenerationError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    for path in written:
        print(f"wrote   {label}/{path}")
    for path in removed:
        print(f"removed {label}/{path}")
    print(f"{len(variants)} variants, {len(written)} files written, {len(removed)} removed")
    return 0


def _vendor(args, parser, outputs) -> int:
    if not args.variant or not args.output:
        parser.error("vendor needs a variant name and -o FILE")
    wanted = Path("triton") / f"{args.variant}.py"
    match = [o for o in outputs if o.path == wanted]
    if not match:
        names = sorted(o.path.stem for o in outputs if o.path.parent.name == "triton" and o.path.stem != "__init__")
        print(f"error: no triton variant {args.variant!r} in the spec; variants: {', '.join(names)}", file=sys.stderr)
        return 2
    args.output.write_text(vendor(match[0], args.variant), encoding="utf-8")
    print(f"wrote {args.output} ({args.variant}, self-contained)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
