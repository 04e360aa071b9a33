"""The package version (one place; ``ddpkit.__version__`` and checkpoints read it here)."""
__version__ = "0.1.0"
