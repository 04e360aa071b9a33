#!/usr/bin/env bash
# The GPU proof in one bounded run (issue 33): on a machine with a CUDA GPU and PyTorch, no
# network. Each step has its own `timeout`; logs and figures go under $OUT (default ./gpu-proof);
# a summary table is printed last. At most 7 files land in $OUT (what a lent machine sends back).
#
#     OUT=/tmp/proof bash scripts/gpu_proof.sh                 # everything
#     OUT=/tmp/proof bash scripts/gpu_proof.sh tests demo      # only the named steps
#
# Steps: env (versions), device_data (ResNet-18 bf16 channels_last batch 512: `ddpkit train` with
# device-resident data vs a hand-written loop whose batches are already on the GPU), peers
# (ddpkit / Accelerate / Lightning Fabric / hand-written DDP step, interleaved, with an A/A
# control), demo (the README's `make demo` command), tests (`make test-gpu`'s tests: kill -9
# resume bitwise in `ddpkit train`, `fit` and an own loop with workers and augmentation, FSDP2,
# GPU->CPU checkpoints, verify on the README example, 2 ranks sharing the GPU over gloo, and the
# asynchronous checkpoints' tests on CUDA), ckpt_async (issue 36: how long a save blocks the step,
# synchronous vs asynchronous from pinned host buffers, DDP and FSDP, 1 process on the GPU).
set -u
OUT=${OUT:-$PWD/gpu-proof}
mkdir -p "$OUT"
STEPS=${*:-env device_data peers demo ckpt_async tests}
# The machine's python3 holds PyTorch (itself a venv: a venv made from it would not see its
# packages); ddpkit comes from src/.
PY=${PY:-python3}
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
summary=()

step() {  # step NAME SECONDS COMMAND...: run bounded, log to $OUT/NAME.log, record rc and time
    local name=$1 limit=$2; shift 2
    case " $STEPS " in *" $name "*) ;; *) return ;; esac
    local start=$SECONDS
    echo "=== $name (at most ${limit}s): $*"
    timeout -k 10 "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    local took=$((SECONDS - start))
    local what="rc $rc"
    [ $rc -eq 124 ] && what="TIMED OUT"
    summary+=("$(printf '| %-12s | %-9s | %5ss | %s |' "$name" "$what" "$took" \
                "$(grep -v '^\s*$' "$OUT/$name.log" | tail -1 | cut -c1-110)")")
    tail -n 25 "$OUT/$name.log"
}

step env 40 bash -c "nvidia-smi -L; nvidia-smi --query-gpu=name,driver_version,memory.total \
    --format=csv; $PY -c 'import torch, sys; print(\"python\", sys.version.split()[0], \"torch\", \
    torch.__version__, \"cuda\", torch.version.cuda, torch.cuda.get_device_name(0))'; \
    $PY -c 'import accelerate, lightning; print(\"accelerate\", accelerate.__version__, \
    \"lightning\", lightning.__version__)'"
step device_data 110 "$PY" benchmarks/device_data.py --rounds 3 --skip-cpu-loader \
    --json "$OUT/device_data.json"
step peers 110 "$PY" benchmarks/peers/run_peers.py --device cuda --nproc 1 --interleave \
    --rounds 3 --steps 40 --warmup 5 --batch 128 --timeout 100 --output /tmp/gpu-proof-peers \
    --peers handwritten,ddpkit,ddpkit-dataloader,accelerate,fabric,handwritten-copy
cp /tmp/gpu-proof-peers/peers.md "$OUT/" 2>/dev/null
step demo 60 "$PY" -m ddpkit train --output /tmp/gpu-proof-demo
step ckpt_async 200 "$PY" benchmarks/ckpt_async/blocking.py --sizes 10 100 350 --engines ddp fsdp \
    --rounds 3 --nproc 1 --dir /tmp
step tests 260 "$PY" -m pytest -q -m gpu -p no:cacheprovider -n 8 --durations=15 \
    tests/test_gpu.py tests/test_async_ckpt.py

echo
echo "| step         | result    |  time  | last line |"
echo "|---|---|---|---|"
printf '%s\n' "${summary[@]}"
