#!/usr/bin/env bash
# Build Horovod 0.28.1 (PyTorch + Gloo; no MPI, TensorFlow or MXNet) against the installed torch.
#
#   scripts/build_horovod.sh [PYTHON]      # PYTHON defaults to $PYTHON, then python3
#
# 0.28.1 is Horovod's last release. Against torch 2.x it builds only with C++17 (torch's headers
# need it; Horovod's CMake asks for C++14) and without build isolation (an isolated build would
# compile against a freshly downloaded torch, not the one that imports it). The wheel is cached in
# ~/.cache/ddpkit (or $DDPKIT_CACHE) per Horovod/torch/Python version and reused when present.
# Horovod is never a dependency of ddpkit: the bench's `horovod` row runs when this succeeded.
set -euo pipefail

PY=${1:-${PYTHON:-python3}}
VERSION=0.28.1
CACHE=${DDPKIT_CACHE:-$HOME/.cache/ddpkit}
TORCH=$("$PY" -c 'import torch; print(torch.__version__.replace("+", "_"))')
PYTAG=$("$PY" -c 'import sys; print("cp%d%d" % sys.version_info[:2])')
WHEELS="$CACHE/horovod-$VERSION-torch$TORCH-$PYTAG"

check() {
    "$PY" -c 'import horovod, horovod.torch; print("horovod", horovod.__version__, "imports")'
    # horovodrun --check-build, through this interpreter (PATH may hold another horovodrun)
    "$PY" -c 'import sys; from horovod.runner.launch import run_commandline
sys.argv = ["horovodrun", "--check-build"]; run_commandline()'
}

if "$PY" -c 'import horovod.torch' 2>/dev/null; then
    echo "horovod.torch already imports"; check; exit 0
fi

# Runtime needs of horovod itself (torch is deliberately not among them: keep the installed one).
"$PY" -m pip install --quiet cloudpickle psutil pyyaml packaging

if compgen -G "$WHEELS/horovod-$VERSION-*.whl" > /dev/null; then
    echo "reusing the wheel built earlier in $WHEELS"
    "$PY" -m pip install --no-deps --force-reinstall "$WHEELS"/horovod-"$VERSION"-*.whl
    check; exit 0
fi

for tool in cmake make g++; do
    command -v "$tool" > /dev/null || { echo "error: $tool is needed to build horovod" >&2; exit 1; }
done

WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
"$PY" -m pip download --quiet --no-deps --no-binary :all: "horovod==$VERSION" -d "$WORK"
tar -xzf "$WORK/horovod-$VERSION.tar.gz" -C "$WORK"
SRC="$WORK/horovod-$VERSION"

# The C++ standard: 14 -> 17 in the top-level and the PyTorch-binding CMakeLists.
for f in "$SRC/CMakeLists.txt" "$SRC/horovod/torch/CMakeLists.txt"; do
    sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' "$f"
    if grep -q 'CMAKE_CXX_STANDARD 14' "$f"; then
        echo "error: could not switch $f to C++17" >&2; exit 1
    fi
done

export HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 \
       HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1
export MAKEFLAGS="-j$(nproc)"
mkdir -p "$WHEELS"
echo "building horovod $VERSION (a few minutes)..."
"$PY" -m pip wheel --no-deps --no-build-isolation -w "$WHEELS" "$SRC"
"$PY" -m pip install --no-deps --force-reinstall "$WHEELS"/horovod-"$VERSION"-*.whl
check
