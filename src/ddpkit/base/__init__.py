"""The base: what every group of the core stands on and that knows none of them (errors, seeding,
the observation hooks, model unwrapping, the worker's first-seconds Ctrl-C handling). Nothing here
imports another ddpkit package.
"""
