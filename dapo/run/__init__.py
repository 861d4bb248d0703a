"""The machinery of a run: checkpoints (one process and sharded), the run directory, signals,
seeding, threads, progress display and metrics logging."""
