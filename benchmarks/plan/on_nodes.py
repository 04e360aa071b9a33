"""Run a script on 2 namespaced nodes (tests/netns.py) behind a link shaped as
``vs_train_nodes.py --bucket 1600`` shapes it (its defaults otherwise), one rank a node, one
thread a rank; rank 0's node output. ``{node}`` in the script's arguments becomes the node's
index. Root only.

    python benchmarks/plan/on_nodes.py 1gbit benchmarks/plan/small_message.py \
        --bytes 61524,123048 --compute-ms 0,4 --calls 1
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import vs_train_nodes  # noqa: E402

#: tbf's bucket from 100 Mbit/s to 1 Gbit/s: one frame, as the plan benchmarks run it
vs_train_nodes.BUCKET = 1600


def main():
    if len(sys.argv) < 3:
        raise SystemExit("usage: on_nodes.py RATE SCRIPT [ARGS...]  (RATE: 1gbit, 100mbit, "
                         "10mbit or none)")
    rate, script = sys.argv[1], os.path.abspath(sys.argv[2])
    print(vs_train_nodes.on_nodes(rate, 29690, [script, *sys.argv[3:]], "run"), end="")


if __name__ == "__main__":
    main()
