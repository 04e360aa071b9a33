"""``python -m ddpkit.cli`` is the ``ddpkit`` command too."""
import sys

from . import main

sys.exit(main())
