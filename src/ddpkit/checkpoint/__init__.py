"""Checkpoints: the files and what they hold (``files``), atomic writes and space, older formats,
sharded (DCP) checkpoints, the shared run directory, and the run's checkpointer with its resume."""
