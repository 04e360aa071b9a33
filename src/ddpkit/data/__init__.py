"""Feeding the ranks: the distributed loader and its exact resume (``loader``), the seeds of its
workers, data kept resident on the device, and what a batch is (its size, device, targets)."""
