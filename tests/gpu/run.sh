#!/usr/bin/env bash
# Every CUDA check in one go, for the first time a GPU is at hand (each skips on a machine without CUDA):
# the csrc kernels against their torch reference, pinning the pool file, session files and tensors through a
# CUDA stage, the device window against the CPU run, GGUF weights kept quantized (the int4 kernel), and short
# 2-stage serves under `strata up` (dense, MoE and Qwen3-Next hybrid linear attention).
#   bash tests/gpu/run.sh            (from the repository root, in the venv with the CUDA build of torch)
set -euo pipefail
cd "$(dirname "$0")/../.."
python - <<'PY'
import torch
assert torch.cuda.is_available(), "torch sees no CUDA device: install the CUDA build of torch first"
print("torch", torch.__version__, "cuda", torch.version.cuda, [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])
PY
python -c "import cupy" 2>/dev/null || pip install -q -e '.[cuda]' || echo "cupy not installed: the kernel tests will skip"
exec timeout 300 python -m pytest -q -rs -p no:cacheprovider \
    tests/stages/test_kernels.py tests/pool/test_pin.py tests/stages/test_snapshot.py tests/stages/test_tensors.py \
    tests/stages/test_window_cuda.py tests/stages/test_quant_linear.py tests/pool/test_state_file.py \
    tests/gpu/test_serve_cuda.py "$@"
