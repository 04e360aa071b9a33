"""Where the stall watch keeps its records: the job's own store (under torchrun, the agent's),
one prefix a job and attempt, which a node's launcher reaches as its workers do
(:mod:`ddpkit.launchers.stacks`).
"""
from __future__ import annotations

import os
from typing import Any, Mapping

__all__ = ["store_prefix", "watch_store"]


def store_prefix(environ: Mapping[str, str]) -> str:
    """The watch's keys for one job in its store, and for one attempt where the store outlives
    an attempt (torchrun's agent store, shared by the restarts of one node); a fresh store each
    round (`ddpkit run` on several nodes) needs none, and there the nodes' restart counts can
    differ, so none is added (as :func:`ddpkit.env.dist.init_process_group` does).

    Example::

        store_prefix({"TORCHELASTIC_RUN_ID": "job", "TORCHELASTIC_RESTART_COUNT": "1",
                      "TORCHELASTIC_USE_AGENT_STORE": "True"})   # 'ddpkit/job/1/'
    """
    attempt = (environ.get("TORCHELASTIC_RESTART_COUNT", "0")
               if environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" else "0")
    return f"ddpkit/{environ.get('TORCHELASTIC_RUN_ID', 'job')}/{attempt}/"


def watch_store(store: Any, environ: Mapping[str, str] = os.environ) -> Any:
    """The job's store itself (under torchrun, the agent's, at the workers' MASTER_ADDR and
    MASTER_PORT) under :func:`store_prefix`, not the process group's prefixes: a node's launcher
    reaches it too, and answers for a stopped worker no other rank on its node can read.

    Example::

        watch = StallWatch(heartbeat, watch_store(rt.engine.store()))
    """
    import torch.distributed as dist

    try:
        root = getattr(store, "_underlying_non_prefix_store", None)
        if root is None:  # an older torch: walk the prefixes down
            root = store
            while isinstance(root, dist.PrefixStore):
                root = root.underlying_store
        if not isinstance(root, dist.Store):  # not a c10d store (Horovod's): as it is
            return store
        return dist.PrefixStore(store_prefix(environ), root)
    except Exception:  # noqa: BLE001 - diagnostics must never break set-up: the group's own
        return store
