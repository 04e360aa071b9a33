"""Collectives that can never complete: every rank waits in one, but not in the same one (a
collective under ``if rt.is_main:``, or called in another order). No rank is stuck, so the stall
watch (:mod:`ddpkit.faults.stall`) finds nobody to name; the waits themselves are the evidence.
Each rank's record carries where it waits (:func:`waiting_site`); the lowest rank compares them.
"""
from __future__ import annotations

import traceback
from typing import Any, Dict, List, Optional

__all__ = ["waiting_site", "mismatch_report"]


def waiting_site(frame: Any) -> Optional[str]:
    """Where a thread waits in a collective: the collective, and the line of the script that
    called it (through which ddpkit function), from its live frame; None if not found.

    Example::

        waiting_site(sys._current_frames()[ident])   # 'all_reduce at train.py:15 via ...'
    """
    from .crash import collective_site

    try:
        op, where = collective_site(traceback.extract_stack(frame))
    except Exception:  # noqa: BLE001 - diagnostics must never break training
        return None
    if op is None and where is None:
        return None
    return f"{op or 'a collective'}" + (f" at {where}" if where else "")


def mismatch_report(records: Dict[int, Dict[str, Any]], world_size: int,
                    waited: float) -> Optional[str]:
    """One report when every rank's (fresh) record waits in a collective and their places
    differ (another collective or another step); None otherwise (a rank not waiting, a place
    not known, all in the same one: a slow transfer, not a mismatch).

    Example::

        mismatch_report({0: {"state": "waiting", "site": "all_reduce at a.py:3", "step": 7},
                         1: {"state": "waiting", "site": "barrier at a.py:9", "step": 7}}, 2, 6)
    """
    if len(records) < world_size or any(
            rec.get("state") != "waiting" or not rec.get("site") for rec in records.values()):
        return None
    places: Dict[Any, List[int]] = {}
    for rank in sorted(records):
        rec = records[rank]
        places.setdefault((rec["site"], rec.get("step")), []).append(rank)
    if len(places) < 2:
        return None
    parts = [f"{_ranks(ranks)} (at step {step}) in {site}" for (site, step), ranks in
             sorted(places.items(), key=lambda item: item[1][0])]
    return (f"ddpkit: every rank has waited {waited:.0f} s in a collective, but not in the same "
            f"one: {'; '.join(parts)}. A collective that some ranks skip (one under "
            "`if rt.is_main:`) or call in another order never completes: call it on every "
            "rank, in the same order\n")


def _ranks(ranks: List[int]) -> str:
    """'rank 0', 'ranks 1-3', 'ranks 0, 2, 5' (runs of consecutive ranks joined)."""
    runs: List[List[int]] = []
    for rank in ranks:
        if runs and rank == runs[-1][-1] + 1:
            runs[-1].append(rank)
        else:
            runs.append([rank])
    text = ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 2 else ", ".join(map(str, r)) for r in runs)
    return f"rank{'s' if len(ranks) > 1 else ''} {text}"
