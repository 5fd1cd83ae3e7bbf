#!/usr/bin/env bash
# Run here (where PyPI is reachable), before a GPU pass: downloads the pure-Python wheels the GPU image
# lacks into .whl/ (ignored by git; name it in the device tool's `carry`). scripts/gpu_pass.sh installs
# them there with --no-index. The image has torch, triton, transformers, accelerate, pytest,
# pytest-xdist, hypothesis and tqdm; it lacks optimum-quanto (Transformers' quanto cache, our baseline).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
mkdir -p .whl
python3 -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "optimum-quanto==0.2.7"
ls -l .whl
