"""What a step costs: the step-time model (``model``), measuring a model's buckets, compute and
links on this machine (``measure``), ``comm_hook="auto"`` and its trial on real steps, and the
batched low-rank compression."""
