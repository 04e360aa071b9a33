#!/usr/bin/env bash
# Every measurement behind benchmarks/RESULTS.md, in the order it was taken, into one directory.
#
#   benchmarks/reproduce.sh [OUT] [PYTHON]      # OUT defaults to bench-out/reproduce
#
# Needs: ddpkit installed in PYTHON's environment with the `plot` and `peers` extras
# (`pip install -e ".[plot,peers]"`), Horovod for its row (`make horovod`), and root with
# `ip netns` + `tc` for the shaped-link part (skipped otherwise). About an hour on 2 quiet cores.
# Run it on an otherwise idle machine: every figure is a ratio of rows measured side by side,
# but a busy machine widens every spread.
set -euo pipefail
OUT=${1:-bench-out/reproduce}
PY=${2:-${PYTHON:-python3}}
mkdir -p "$OUT"
log() { echo "== $(date -u +%H:%M:%S) $*" | tee -a "$OUT/commands.log"; }

log "ddpkit bench (default rows, ResNet-18, interleaved rounds within the 540 s budget)"
"$PY" -m ddpkit bench --output "$OUT/default"

log "scaling: single-1t vs 2 independent processes vs DDP (4 interleaved rounds)"
"$PY" -m ddpkit bench --rows single-1t,indep,ddp,ddp-cl --repeats 4 --budget 900 \
    --output "$OUT/scaling"

log "peers: hand-written DDP, ddpkit, Accelerate, Fabric (rotated order, 3 rounds)"
"$PY" benchmarks/peers/run_peers.py --rounds 3 --output "$OUT/peers"

log "peers, step-interleaved in one job per round (+ ddpkit without gradient_as_bucket_view)"
"$PY" benchmarks/peers/run_peers.py --peers handwritten,ddpkit,accelerate,fabric,ddpkit-nobv \
    --interleave --rounds 4 --steps 6 --output "$OUT/peers-interleaved"

log "peers, A/A control: hand-written vs an identical copy of itself, and ddpkit"
"$PY" benchmarks/peers/run_peers.py --peers handwritten,ddpkit,handwritten-copy \
    --interleave --rounds 4 --steps 8 --output "$OUT/peers-control"

log "where a step's time goes: hand-written vs ddpkit, alternating, both build orders"
"$PY" -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/peers/components.py \
    --steps 12 | tee "$OUT/components.txt"
"$PY" -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/peers/components.py \
    --steps 12 --ddpkit-first | tee -a "$OUT/components.txt"

log "all-reduce of the ResNet-18 gradient between 2 processes (communication share of a step)"
"$PY" benchmarks/allreduce_probe.py --repeats 10 | tee "$OUT/allreduce.txt"

log "accuracy mode: every row trained on the real digits data, exact top-1"
"$PY" -m ddpkit bench --accuracy --output "$OUT/accuracy"

if [ "$(id -u)" = 0 ] && command -v ip > /dev/null && command -v tc > /dev/null; then
    log "shaped links between 2 network namespaces (tbf), hooks x link speeds"
    "$PY" benchmarks/multinode/shaped_links.py --out "$OUT/shaped" --rounds 2 --steps 3 \
        --hooks none fp16 bf16 powersgd1 powersgd2
    log "shaped links: the goal's cells only (unshaped vs 100 Mbit/s)"
    "$PY" benchmarks/multinode/shaped_links.py --out "$OUT/shaped-quiet" --rates unshaped 100mbit \
        --hooks none bf16 powersgd1 --rounds 2 --steps 3 --accuracy-hooks
else
    log "shaped links skipped: needs root, ip and tc"
fi
log "done"
