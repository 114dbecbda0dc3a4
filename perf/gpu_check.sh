#!/usr/bin/env bash
# Everything that needs a GPU, in one run for a machine lent by the minute: the tests that
# skip without CUDA (plain, then under PyTorch's CUDA sanitizer), the memory table from the
# CUDA allocator, the FSDP2 example on one GPU (nccl), then the GPU report. tests/test_cuda.py holds the engine's GPU checks:
# hooks with Event/Stream.synchronize and pinned allocation patched to raise and
# set_sync_debug_mode("error"), and race windows widened with torch.cuda._sleep.
# Uses the python3 on PATH as it is (on a lent H200 it holds a CUDA build of torch, pytest
# and pytest-benchmark) and this checkout's package. Logs and JSON go to $OUT if set, else
# perf/results/. Exits non-zero if any part failed, after running them all.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
out="${OUT:-perf/results}"
mkdir -p "$out"
python3 -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; \
print('torch', torch.__version__, 'on', torch.cuda.get_device_name())" || exit 1
status=0
python3 -m pytest -q -rs -p no:cacheprovider -k "cuda or Cuda" \
    tests/test_cuda.py tests/test_accounting.py tests/test_training.py 2>&1 \
    | tee "$out/gpu_tests.log" || status=1
TORCH_CUDA_SANITIZER=1 timeout 300 python3 -m pytest -q -rs -p no:cacheprovider \
    tests/test_cuda.py 2>&1 | tee "$out/gpu_tests_sanitizer.log" || status=1
timeout 120 python3 -m torch.distributed.run --nproc-per-node 1 examples/train_fsdp.py \
    --steps 10 2>&1 | tee "$out/gpu_fsdp_example.log" || status=1
python3 -m perf.memory_report --device cuda --json "$out/memory_cuda.json" 2>&1 \
    | tee "$out/memory_cuda.md" || status=1
timeout 420 python3 perf/gpu_report.py --json "$out/gpu_report.json" 2>&1 \
    | tee "$out/gpu_report.md" || status=1
exit "$status"
