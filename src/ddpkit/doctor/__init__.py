"""``ddpkit doctor``: versions, devices, backends, routes, ports, clocks and whether the
checkpoint directory is shared, checked across the ranks of a job (``checks``, ``cluster``), and
an all-reduce sweep fitted to the latency and bandwidth ``ddpkit plan`` predicts from; one line
per finding (``run``).
"""
from .checks import Finding
from .run import main

__all__ = ["Finding", "main"]
