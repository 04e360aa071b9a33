#!/usr/bin/env bash
# Install what the real-Slurm tests (tests/test_slurm.py) need: Debian's slurm-wlm (slurmctld,
# slurmd and the clients) and munge, from the package registry. Nothing is configured or started
# here: each test brings up its own private cluster (tests/slurmcluster.py) and removes it.
#
#   sudo bash scripts/install_slurm.sh
#
# Exit status 0 when everything is present afterwards; 3 when it cannot install here (not root, no
# apt-get: the Slurm tests then skip with the reason, as the namespace tests do); 1 when the install
# failed. `make test` calls it: in CI (CI=true) a failed install fails the run. The packages'
# own services are not used (on a host with systemd, installing munge starts the system munged).
set -euo pipefail

need=(slurmctld slurmd sbatch srun scontrol squeue scancel sinfo munged mungekey nsenter)
missing() { for tool in "${need[@]}"; do command -v "$tool" >/dev/null || echo "$tool"; done; }

if [ -z "$(missing)" ]; then
    echo "slurm: $(slurmd -V 2>/dev/null), $(munged -V 2>/dev/null | head -n1): present"
    exit 0
fi
if [ "$(id -u)" != 0 ]; then
    echo "slurm: not installed ($(missing | tr '\n' ' ')) and not root: the Slurm tests will skip" >&2
    exit 3
fi
if ! command -v apt-get >/dev/null; then
    echo "slurm: not installed and no apt-get here: install slurm-wlm and munge yourself" >&2
    exit 3
fi
export DEBIAN_FRONTEND=noninteractive
# The package index may be missing (a fresh container) or stale: refresh it only if needed. A
# fresh VM's unattended upgrades may hold the dpkg lock for a while: wait for it.
apt=(apt-get -y -q -o DPkg::Lock::Timeout=300)
if ! "${apt[@]}" install --no-install-recommends slurm-wlm munge util-linux </dev/null >/dev/null 2>&1; then
    "${apt[@]}" update </dev/null >/dev/null
    "${apt[@]}" install --no-install-recommends slurm-wlm munge util-linux </dev/null >/dev/null
fi
left=$(missing | tr '\n' ' ')
if [ -n "$left" ]; then
    echo "slurm: still missing after the install: $left" >&2
    exit 1
fi
echo "slurm: installed $(slurmd -V), $(munged -V | head -n1)"
