#!/usr/bin/env bash
# Issue 53, item 8, on a lent H200 (the device tool), in under 8 minutes:
#   benchmarks/recovery_scale_gpu.py: DP2 on one GPU (gloo on CUDA tensors), >= 1 GiB of state
#   per rank, rank 1 SIGKILLed and replaced, regroup, rejoin, heal; peak CUDA memory per role.
# The device machine's image has torch but not megatron-core: carry its wheel (and its
# dependencies that are missing there) in .whl, as .library/device/README.md says, e.g. here:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_28_x86_64 -d .whl megatron-core==0.16.1
# then run there: bash scripts/gpu_recovery_scale.sh (with carry: [".whl"]).
set -euo pipefail
cd "$(dirname "$0")/.."
if ls .whl/*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
python3 -c "import megatron.core, torch; assert torch.cuda.is_available()"
out=${OUT:-results/gpu}
mkdir -p "$out"
timeout 450 python3 benchmarks/recovery_scale_gpu.py --out "$out/recovery_scale_h200.json"
