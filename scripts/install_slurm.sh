#!/usr/bin/env bash
# Install what the real-Slurm tests (tests/test_slurm.py) need: Debian's slurm-wlm (slurmctld,
# slurmd and the clients) and munge, from the package registry. Nothing is configured or started
# here: each test brings up its own private cluster (tests/slurmcluster.py) and removes it.
#
#   sudo bash scripts/install_slurm.sh
#
# Exit status 0 when everything is present afterwards; otherwise 1 with the reason (not root, not
# Debian/Ubuntu, the install failed). `make test` calls it: in CI (CI=true) a failure fails the
# run; elsewhere the Slurm tests skip with the reason.
set -euo pipefail

need=(slurmctld slurmd sbatch srun scontrol squeue scancel sinfo munged mungekey nsenter)
missing() { for tool in "${need[@]}"; do command -v "$tool" >/dev/null || echo "$tool"; done; }

if [ -z "$(missing)" ]; then
    echo "slurm: $(slurmd -V 2>/dev/null), $(munged -V 2>/dev/null | head -n1): present"
    exit 0
fi
if [ "$(id -u)" != 0 ]; then
    echo "slurm: not installed ($(missing | tr '\n' ' ')) and not root: the Slurm tests will skip" >&2
    exit 1
fi
if ! command -v apt-get >/dev/null; then
    echo "slurm: not installed and no apt-get here: install slurm-wlm and munge yourself" >&2
    exit 1
fi
export DEBIAN_FRONTEND=noninteractive
# The package index may be missing (a fresh container) or stale: refresh it only if needed.
if ! apt-get install -y -q --no-install-recommends slurm-wlm munge util-linux >/dev/null 2>&1; then
    apt-get update -q >/dev/null
    apt-get install -y -q --no-install-recommends slurm-wlm munge util-linux >/dev/null
fi
left=$(missing | tr '\n' ' ')
if [ -n "$left" ]; then
    echo "slurm: still missing after the install: $left" >&2
    exit 1
fi
echo "slurm: installed $(slurmd -V), $(munged -V | head -n1)"
