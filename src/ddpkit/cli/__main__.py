"""``python -m ddpkit.cli`` is the ``ddpkit`` command too."""

from . import entry

entry()
