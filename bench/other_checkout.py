"""The start of a worker process that runs another checkout of sicl_fast, for the before / after benchmarks
(bench/ab_step.py, bench/kernel_count.py, bench/same_histories.py): `python -c PRELUDE + body ROOT ...`, and
`run_worker`, which runs one and reads the JSON object it prints last.

PRELUDE hides this environment's editable install of sicl_fast, puts ROOT (sys.argv[1]) first on sys.path, maps
ROOT's kernels/ folder to sicl_fast.kernels as the install maps it (when ROOT has one), and checks that the
sicl_fast imported is ROOT's. Environment variables the checkout reads at import (TRITON_INTERPRET) are the
caller's to set, in the subprocess's environment.
"""

import json
import subprocess
import sys

PRELUDE = r"""
import importlib.util, os, sys
root = sys.argv[1]
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in type(f).__module__.lower()
                    and "editable" not in getattr(f, "__name__", "").lower()]
sys.path.insert(0, root)
import sicl_fast
assert sicl_fast.__file__.startswith(root), sicl_fast.__file__
if os.path.isdir(os.path.join(root, "kernels")):
    _spec = importlib.util.spec_from_file_location("sicl_fast.kernels", os.path.join(root, "kernels", "__init__.py"),
                                                   submodule_search_locations=[os.path.join(root, "kernels")])
    _kernels = importlib.util.module_from_spec(_spec)
    sys.modules["sicl_fast.kernels"] = _kernels
    _spec.loader.exec_module(_kernels)
"""


def run_worker(worker: str, root, *argv, timeout: int = 900, env: dict | None = None) -> dict:
    """Run `worker` (PRELUDE + a body) on the checkout `root` with the arguments argv in a new interpreter; the JSON
    object of its last output line. A failed worker ends the run with its error."""
    out = subprocess.run([sys.executable, "-c", worker, str(root), *map(str, argv)], capture_output=True, text=True,
                         timeout=timeout, env=env)
    if out.returncode != 0:
        raise SystemExit(f"{root}: {out.stderr.strip()[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])
