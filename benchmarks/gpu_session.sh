#!/usr/bin/env bash
# One GPU session in one call (device time is scarce): build against the machine's torch (or install the release
# wheel GRPO_EXT_WHEEL names, e.g. dist/grpo_ext-*.whl from `make wheel`: the same file on any torch >= 2.11), run
# every test, run compute-sanitizer over the CUDA tests, run the benchmarks. Logs and JSON go to $OUT (./gpu-out).
#   usage: [GRPO_EXT_WHEEL=dist/grpo_ext-....whl] bash benchmarks/gpu_session.sh [all|test|sanitize|bench]
set -uo pipefail
OUT="${OUT:-$PWD/gpu-out}"
mkdir -p "$OUT"
what="${1:-all}"
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0+PTX}" GRPO_EXT_CUDA=ON

{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv
  python3 -c "import torch, sys; print(sys.version); print('torch', torch.__version__, 'cuda', torch.version.cuda)"
  nvcc --version | tail -2
} 2>&1 | tee "$OUT/build.txt"

if [[ -n "${GRPO_EXT_WHEEL:-}" ]]; then
  python3 -m pip install -q --no-deps --force-reinstall "$GRPO_EXT_WHEEL" 2>&1 | tail -5 | tee -a "$OUT/build.txt"
else
  make build PYTHON_ENV=system 2>&1 | tail -20 | tee -a "$OUT/build.txt"
fi
cd /tmp && python3 -c "import grpo_ext, json; info = grpo_ext.build_info(); print(json.dumps(info))
assert info['cuda_kernels_registered']" 2>&1 | tee -a "$OUT/build.txt"
[[ "${PIPESTATUS[0]}" == 0 ]] || exit 1
cd - >/dev/null

if [[ "$what" == all || "$what" == test ]]; then
  python3 -m pytest -q -p no:cacheprovider -rs 2>&1 | tail -40 | tee "$OUT/pytest.txt"
fi
if [[ "$what" == all || "$what" == sanitize ]]; then
  sel="cuda and (float64_kernel or deterministic or masked_positions or every_dtype or large or process_advantages_match or inplace_grad or masked_rows_never_read)"
  for tool in memcheck racecheck; do
    compute-sanitizer --tool "$tool" --error-exitcode 9 --print-limit 20 \
      python3 -m pytest -q -p no:cacheprovider -x -k "$sel" tests/test_grpo_loss.py tests/test_group_advantages.py \
      tests/test_process_advantages.py \
      tests/test_grpo_loss_from_logits.py \
      2>&1 | tail -15 | tee "$OUT/sanitizer-$tool.txt"
    echo "compute-sanitizer $tool exit: ${PIPESTATUS[0]}" | tee -a "$OUT/sanitizer-$tool.txt"
  done
fi
if [[ "$what" == all || "$what" == bench ]]; then
  python3 benchmarks/bench_group_advantages.py 2>&1 | tee "$OUT/bench_group_advantages.txt"
  python3 benchmarks/bench_process_advantages.py 2>&1 | tee "$OUT/bench_process_advantages.txt"
  python3 benchmarks/bench_grpo_loss.py 2>&1 | tee "$OUT/bench_grpo_loss.txt"
  python3 benchmarks/bench_selective_log_softmax.py 2>&1 | tee "$OUT/bench_selective_log_softmax.txt"
  python3 benchmarks/bench_grpo_loss_from_logits.py 2>&1 | tee "$OUT/bench_grpo_loss_from_logits.txt"
  python3 benchmarks/bench_grpo_loss_from_hidden.py 2>&1 | tee "$OUT/bench_grpo_loss_from_hidden.txt"
  python3 benchmarks/bench_overhead.py --sizes 64x1024x64 2>&1 | tee "$OUT/bench_overhead.txt"
  cp benchmarks/out/*.json "$OUT/" 2>/dev/null
fi
