"""A script that does not compile (tests/test_cli.py: one line before any process starts)."""
import ddpkit
x = (
