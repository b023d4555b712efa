"""How a run is set up: plan, knob ranges, entry checks, threads, CUDA graphs, run arguments, progress, workers."""
