"""``python -m ddpkit`` is the ``ddpkit`` command."""

from .cli import entry

if __name__ == "__main__":
    entry()
