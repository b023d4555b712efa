#!/usr/bin/env python3
"""The conformance sweep over every causal-LM architecture of the installed transformers, and docs/usage.md's model
table from it (sicl_fast.diagnostics.conformance: a tiny random-weight model of each, the hf backend against the
model's own full logits with eager attention, auto's fast backend against hf; tests/test_conformance.py runs a
representative set of it in the suite and checks that the table is current).

    python scripts/model_table.py                              the whole sweep; the table on stdout
    python scripts/model_table.py --write docs/usage.md        into the document, between its markers
    python scripts/model_table.py --families llama cohere      some families only (not with --write)

One line per architecture on stderr as it goes (status, seconds). Exit status 1 when a backend gives other numbers
than the model's own (a row 'wrong'), 2 on bad arguments (an unknown model type; a --write document that cannot be
read or written or holds no table's markers, checked before the sweep). A family named twice is checked once.
"""
from __future__ import annotations

import argparse
import sys
import time


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="model_table.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--write", metavar="DOC", help="replace the model table in DOC (docs/usage.md) with the result")
    p.add_argument("--families", nargs="+", metavar="TYPE", help="only these model types (not with --write)")
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    from sicl_fast.diagnostics.conformance import check, check_doc, families, render, write
    from sicl_fast.errors import SiclError

    known = families()
    names = list(dict.fromkeys(args.families or known))  # a family named twice is checked (and listed) once
    unknown = [n for n in names if n not in known]
    if unknown or (args.write and args.families):
        what = f"unknown model types: {', '.join(unknown)}" if unknown else "--write needs the whole sweep"
        print(f"model_table.py: {what}", file=sys.stderr)
        return 2
    if args.write:
        try:  # before the sweep: a document it could not rewrite would lose a minute's table at the end
            check_doc(args.write)
        except SiclError as exc:
            print(f"model_table.py: {exc}", file=sys.stderr)
            return 2
    import transformers

    t0, rows = time.perf_counter(), []
    for i, name in enumerate(names, 1):
        row = check(name)
        rows.append(row)
        print(f"[{i}/{len(names)}] {name}: {row.status} ({row.seconds:.2f} s)", file=sys.stderr, flush=True)
    table = render(rows, transformers.__version__)
    if args.write:
        try:
            write(args.write, table)
        except (SiclError, OSError) as exc:  # changed or removed during the sweep: the table is not lost
            print(table)
            print(f"model_table.py: {exc}; the table is on stdout", file=sys.stderr)
            return 2
        took = time.perf_counter() - t0
        print(f"wrote the model table of {len(rows)} architectures into {args.write} ({took:.0f} s)", file=sys.stderr)
    else:
        print(table)
    return 1 if any(r.status == "wrong" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
