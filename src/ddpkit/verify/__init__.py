"""``ddpkit verify``: does a user's own script compute the same on N processes as on one? It runs
the unchanged script several ways (``runs``), merges what every rank recorded (``records``),
compares step by step within measured tolerances and names the cause of a difference
(``compare``), then prints the table and the verdict (``report``).
"""
from .compare import Verdict, compare
from .runs import verify

__all__ = ["verify", "compare", "Verdict"]
