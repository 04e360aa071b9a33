"""The modules that moved into the layers (0.x: ``ddpkit.comm`` is now ``ddpkit.engines.comm``,
``ddpkit.loop`` ``ddpkit.training.loop``, ...) still import by their old names: a script written
for the flat layout keeps working. One exception: ``ddpkit.evaluate`` is the function only (the
module, ``ddpkit.training.evaluation``, no longer shadows it). The old name is an alias of the module, not a copy (one
``sys.modules`` entry's object under two names), and nothing loads until it is imported.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from typing import Any, Dict, Optional

__all__ = ["MOVED", "install"]

#: old module name -> where it lives now
MOVED: Dict[str, str] = {
    "ddpkit.comm": "ddpkit.engines.comm",
    "ddpkit.errors": "ddpkit.base.errors",
    "ddpkit.seed": "ddpkit.base.seed",
    "ddpkit.observe": "ddpkit.base.observe",
    "ddpkit.wrap": "ddpkit.base.wrap",
    "ddpkit.runtime": "ddpkit.training.runtime",
    "ddpkit.loop": "ddpkit.training.loop",
    "ddpkit.fitconfig": "ddpkit.training.fitconfig",
    "ddpkit.accumulate": "ddpkit.training.accumulate",
    "ddpkit.precision": "ddpkit.training.precision",
    "ddpkit.log": "ddpkit.training.log",
    "ddpkit.data.batches": "ddpkit.training.batches",
}


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Optional[Any]:
        if name not in MOVED:
            return None
        return importlib.util.spec_from_loader(name, self)

    def create_module(self, spec: Any) -> Any:
        return importlib.import_module(MOVED[spec.name])

    def exec_module(self, module: Any) -> None:
        pass  # the module it names ran already


def install() -> None:
    """Let the old names import (once per interpreter).

    Example::

        install()
        import ddpkit.comm          # the module ddpkit.engines.comm
    """
    if not any(isinstance(f, _Alias) for f in sys.meta_path):
        sys.meta_path.append(_Alias())
