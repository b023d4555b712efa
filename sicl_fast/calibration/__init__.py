"""The ascent: eager, static and packed loops, their state and stop rule, estimator, proxy, noise, spec, gradient;
a prompt's static step planned once (step_plan)."""
