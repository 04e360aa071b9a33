"""The checkpointer in a fault-tolerant run (:mod:`ddpkit.engines.live`): what a replica that
joins takes from a live peer (the same state a checkpoint holds), the optimizer stepped only on
a committed step, and a step that did not commit undone for the schedule and the count.
"""
from __future__ import annotations

import copy
from typing import Any, Optional

from ..base.errors import ConfigError
from ..engines import live as live_engine

__all__ = ["LiveSteps", "attach"]


class LiveSteps:
    """One checkpointer's side of the live replicas.

    Example::

        steps = attach(ckpt)      # None outside a fault-tolerant run
        counted = steps.settle()  # after each optimizer step: did it commit?
    """

    def __init__(self, ckpt: Any, live: Any) -> None:
        self.ckpt, self.live = ckpt, live
        self.skipped = 0          # steps that did not commit (given again)
        self._skipped_now = False
        self._schedule = self._snapshot()
        self._gate = live_engine.gate_optimizer(ckpt.optimizer, live, self._on_skip)
        live.manager.register_state_dict_fn("ddpkit", self._load, self._state)
        live.attached = True

    def _state(self) -> Any:  # what a joining replica takes: a checkpoint's contents
        return self.ckpt.state_dict()

    def _load(self, state: Any) -> None:
        self.ckpt.load_state_dict(state)
        self._schedule = self._snapshot()

    def _on_skip(self) -> None:
        self._skipped_now = True

    def _snapshot(self) -> Optional[Any]:
        scheduler = self.ckpt.parts.get("scheduler")
        return copy.deepcopy(scheduler.state_dict()) if scheduler is not None else None

    def settle(self) -> bool:
        """After the loop's optimizer step: True when it committed; else the schedule is put
        back as it was (it counts committed steps) and the step is not counted."""
        if not self._skipped_now:
            self._schedule = self._snapshot()
            return True
        self._skipped_now = False
        self.skipped += 1
        scheduler = self.ckpt.parts.get("scheduler")
        if scheduler is not None and self._schedule is not None:
            scheduler.load_state_dict(copy.deepcopy(self._schedule))
        return False

    def close(self) -> None:
        self._gate.remove()


def attach(ckpt: Any) -> Optional[LiveSteps]:
    """In a fault-tolerant run: tie ``ckpt`` to the live replicas and join the first quorum
    (a replica that joins a running job takes a live peer's state here); None otherwise."""
    live = live_engine.current()
    if live is None:
        return None
    if ckpt.optimizer is None:
        raise ConfigError("a fault-tolerant run steps the optimizer only when every live "
                          "replica finished the step: pass optimizer= to rt.checkpointer")
    steps = LiveSteps(ckpt, live)
    live.join()
    if live.heals:
        live_engine.say(f"replica {live_engine.replica_name()} joined at step {live.step} "
                        "with a live peer's state")
    return steps
