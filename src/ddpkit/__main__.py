"""``python -m ddpkit`` is the ``ddpkit`` command."""
import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
