"""``python -m ddpkit.doctor``: the doctor on every rank of the job that runs it."""
import os
import sys

from ..base.errors import DDPKitError
from .run import main

if __name__ == "__main__":
    try:
        sys.exit(main())
    except DDPKitError as exc:
        if os.environ.get("RANK", "0") == "0":  # one line, from rank 0
            print(f"error: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)
