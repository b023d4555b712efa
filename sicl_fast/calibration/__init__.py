"""The ascent's loops: the eager reference loop (ascent: Calibrator), the static, sync-free step (static) and the
packed step (packed), the read loop both share (reads), a prompt's static step planned once (step_plan), and the
exact gradient (grad). One step's math (proxy, noise, estimator, spec, stop rule) is sicl_fast.step's."""
