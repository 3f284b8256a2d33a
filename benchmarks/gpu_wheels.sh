#!/usr/bin/env bash
# Download the peer wheels the GPU run installs offline (the GPU machine has no network) into .whl/ (git-ignored):
# flash-sparse-attn 2.0.6, pure Triton, py3-none-any. It needs nothing the GPU image lacks for its attention kernels
# (torch, triton); its projection kernels import Triton's in-repo `triton_kernels`, which no registry ships,
# and benchmarks/peers.py stubs those names. Then run the GPU command with carry [".whl"] (docs/gpu.md).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
mkdir -p .whl
"$PYTHON" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform any -d .whl "flash-sparse-attn==2.0.6"  # the version benchmarks/peers.py was written against
ls -l .whl
