"""The `sicl-fast` command line and the work it dispatches (the calibrate work functions, the Ray pool)."""
