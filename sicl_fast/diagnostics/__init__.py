"""Measurements of the engine: the step benchmark, the profile, kernel counts, the estimator study."""
