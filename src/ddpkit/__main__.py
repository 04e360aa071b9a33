"""``python -m ddpkit`` is the ``ddpkit`` command."""

try:
    from .cli import entry
except KeyboardInterrupt:  # Ctrl-C while the command's modules load: one line, not a traceback
    import os as _os
    import sys as _sys

    print("interrupted", file=_sys.stderr, flush=True)
    _os._exit(130)

if __name__ == "__main__":
    entry()
