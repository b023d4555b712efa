"""Rebuild the ICLEval excerpts in this folder from the released files.

    python tests/data/icleval/make_excerpts.py /path/to/ICLEval/data/tasks_data

Each excerpt is a JSON array of some samples of one released file, every sample copied unmodified: the released
files are `json.dumps(items, indent=4, ensure_ascii=False)`, so each sample's text here is byte-identical to its
text there. The uids below are the ones the tests use (SPEC 9's golden values, the token-span checks, and the
first samples that `--limit` runs take).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

UIDS = {
    "classifier_order": [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 50, 99],
    "generate_order": [0, 1, 2, 3, 4, 30, 60, 239],
    "generate_list_number": [0, 1, 2, 249],
}


def main(src: str) -> None:
    here = Path(__file__).resolve().parent
    for name, uids in UIDS.items():
        text = (Path(src) / f"{name}.json").read_text(encoding="utf-8")
        items = json.loads(text)
        assert json.dumps(items, indent=4, ensure_ascii=False) == text, f"{name}: not in the released layout"
        picked = [items[u] for u in uids]
        assert [it["uid"] for it in picked] == uids, name
        (here / f"{name}.json").write_text(json.dumps(picked, indent=4, ensure_ascii=False), encoding="utf-8")


if __name__ == "__main__":
    main(sys.argv[1])
