"""The training front: what a script calls (:func:`ddpkit.setup` and its
:class:`~ddpkit.training.runtime.Runtime`, :func:`ddpkit.fit`, :func:`ddpkit.evaluate`, precision,
accumulation, logging, how a batch and a model's output are read). It stands on the core's groups
(checkpoint > data > engines > cost | faults | env) and the base below them; no group imports it.
"""
