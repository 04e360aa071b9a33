"""``ddpkit verify``: does a user's own script compute the same on N processes as on one? It runs
the unchanged script several ways (``runs``), merges what every rank recorded (``records``),
compares step by step within measured tolerances (``compare``), names a cause only on its own
evidence (``diagnose``, ``evidence``, ``metrics``; otherwise ``unexplained``), then prints the
table, the evidence and the verdict (``report``).
"""
from .compare import Verdict, compare
from .runs import verify

__all__ = ["verify", "compare", "Verdict"]
