"""``ddpkit plan``: will more nodes be faster, and should the gradients be compressed? The cost
model of a DDP step (``ddpkit.cost.model``: alpha-beta ring all-reduce, buckets overlapped with backward, each
comm hook's bytes and compute) fed with a model's buckets and measured compute (``predict``),
printed as a table with the recommendation (``report``).
"""
from ..cost.measure import Workload
from ..cost.model import LINKS, Link, fit_link, ring_allreduce_seconds, step_time
from .predict import predict, recommend

__all__ = ["LINKS", "Link", "fit_link", "ring_allreduce_seconds", "step_time", "Workload",
           "predict", "recommend"]
