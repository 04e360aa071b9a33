#!/usr/bin/env bash
# Final top-1 of `ddpkit train` on 2 local processes with each compressor, seeds 0-2 (issue 24:
# why auto considers batched PowerSGD at rank 4 only). ~8 min on 2 cores. Run from the repo root:
#     bash benchmarks/plan/accuracy.sh | sort
cd "$(dirname "$0")/../.."
mkdir -p "${TMPDIR:-/tmp}/ddpkit-acc"
run() { # label epochs batch hook rank start seed
  out=${TMPDIR:-/tmp}/ddpkit-acc/f-$1-$3-s$7; rm -rf $out
  OMP_NUM_THREADS=1 ${PYTHON:-python} -m ddpkit train --nproc 2 --epochs $2 --batch-size $3 --seed $7 --output $out --no-progress $([ $4 != none ] && echo --comm-hook $4 --powersgd-rank $5 --powersgd-start-iter $6) > $out.log 2>&1
  printf "%s %s %s\n" "$1 b$3" "seed $7" "$(python3 -c "import json;print('%.2f' % json.load(open('$out/results.json'))['final']['eval/top1'])")"
}
for seed in 0 1 2; do
  for spec in "none none 0 0" "p2s2 powersgd 2 2" "b8s2 powersgd-batched 8 2" "b4s2 powersgd-batched 4 2" "b2s10 powersgd-batched 2 10" "b2s2 powersgd-batched 2 2"; do set -- $spec; run $1 12 64 $2 $3 $4 $seed; done
  for spec in "none none 0 0" "p2s2 powersgd 2 2" "b8s2 powersgd-batched 8 2" "b4s2 powersgd-batched 4 2" "b4s10 powersgd-batched 4 10" "b2s2 powersgd-batched 2 2"; do set -- $spec; run $1 20 256 $2 $3 $4 $seed; done
done
