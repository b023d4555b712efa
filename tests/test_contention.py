"""bench/contention.py end to end on a tiny model: one worker process, quiet and beside two busy processes that the
script starts and stops itself; the markdown table and the JSON file (no timing is asserted)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "contention.py"


def test_contention_table_and_json(tiny_model_dir, tmp_path):
    out = tmp_path / "c.json"
    run = subprocess.run([sys.executable, str(SCRIPT), "--model", str(tiny_model_dir), "--length", "400", "--N", "2",
                          "--repeats", "1", "--settle", "0.1", "--threads", "1", "--policies", "passive",
                          "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert "uptime before:" in lines[0] and lines[1].startswith("| wait policy | threads | backend |")
    assert [line.split("|")[1:4] for line in lines[3:]] == [[" passive ", " 1 ", " fast "],
                                                            [" passive ", " 1 ", " hf "]]
    facts = json.loads(out.read_text())
    assert "load average" in facts["uptime_before"] and facts["load"] == 2
    assert {(r["phase"], r["backend"], r["threads"], r["wait_policy"]) for r in facts["rows"]} == {
        (phase, b, 1, "passive") for phase in ("quiet", "loaded") for b in ("fast", "hf")}
