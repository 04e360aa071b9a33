#!/usr/bin/env bash
# Provision an environment for `make ... VENV=/tmp/venv` on a GPU machine that has PyTorch but
# no network (the lent device machine): a venv over the system site-packages, ddpkit from src/
# (a .pth file and the `ddpkit` executable), and the test tools from wheels carried in .whl/.
set -euo pipefail
venv=${1:-/tmp/venv}
python3 -m venv --system-site-packages "$venv"
site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "$PWD/src" > "$site/ddpkit-src.pth"
printf '#!%s\nfrom ddpkit.cli import entry\nentry()\n' "$venv/bin/python" > "$venv/bin/ddpkit"
chmod +x "$venv/bin/ddpkit"
if ls .whl/*.whl >/dev/null 2>&1; then
    "$venv/bin/python" -m pip install -q --no-index --no-deps .whl/*.whl
fi
touch "$venv/.installed" "$venv/.horovod"   # nothing to install or build: make skips those steps
"$venv/bin/python" -c 'import torch, ddpkit; print("torch", torch.__version__, "cuda", torch.cuda.is_available(), "ddpkit", ddpkit.__version__)'
