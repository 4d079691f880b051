#!/usr/bin/env bash
# One GPU session in one call, under 8 minutes on an H100 (365 s on 2026-11-26; 509 s on an H200 on 2026-11-27 with
# the compile stage, since moved out, and a trainer stage cut at its limit; device time is scarce): install the release wheel (or build against the machine's torch), run the CUDA tests,
# compute-sanitizer over a selection, then the benchmarks, each stage under its own time limit so that a slow one
# cannot eat the next. Logs and JSON go to $OUT (./gpu-out); the short table (bench_floor.py) and the summary are
# printed last.
#   usage: [GRPO_EXT_WHEEL=dist/grpo_ext-....whl] [WHEELS=.whl] bash benchmarks/gpu_session.sh
#          [all|test|sanitize|bench|floor|micro|trainer|compile|profile][,...]   (floor: bench_floor.py alone;
#          micro: bench_group_advantages.py and bench_overhead.py; bench: floor, micro and one trainer row; trainer:
#          issue 39's other step rows; compile: the torch.compile peer; profile: Nsight Compute over the logits layouts;
#          the last three are not part of all)
# WHEELS: a folder of wheels the machine lacks (liger-kernel, trl and its few missing needs; bench_floor.py times
# Liger's and TRL's kernels, bench_trainer.py TRL's trainer), installed into
# /tmp/site with no network: `python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12
# --platform manylinux_2_28_x86_64 -d .whl liger-kernel trl==1.16.0 datasets==4.7.0 dill==0.4.1 multiprocess==0.70.19`
# here (the H100 machine of 2026-11-26 had the rest), then carry .whl and dist.
# Two calls fit the 15 minutes of a lease (2026-11-27, fifth session, an H200): `test,floor,profile` then `sanitize`
# in one (347 s), then `trainer` with TRAINER_CASES="qwen2.5-0.5b:1024:0 qwen2.5-1.5b:1024:0" (274 s); give it back.
# Since then `micro` (about 40 s) belongs in the first call, and `floor` times two more masks per shape (about
# 40 s more): `timeout -k 5 440 ... test,floor,micro,profile`, then `timeout -k 5 170 ... sanitize`.
# What they decide (NOTES.md's predictions, written before): `floor` the logits layouts on the card, issue 38 item
# 2's verdicts (its last table: floor_targets.py) and the head's chunk sweep at Qwen2.5-0.5B's H 896 ("The head at H
# 896"); `micro` issue 38 item 4's group_ids and per-call rows; `profile` where the small blocks' instructions go;
# `trainer` the step's peak after the tied lookup and the one-chunk-of-logits fix ("Two chunks of logits alive").
# The device tool returns at most 8 files from its $OUT, and this writes about 16: point OUT elsewhere and pack it,
# under a limit that leaves time to pack (2026-11-27): D=$OUT; export OUT=/tmp/g; WHEELS=.whl GRPO_EXT_WHEEL=$(ls
# dist/*.whl) timeout -k 5 540 bash benchmarks/gpu_session.sh all; tar czf $D/gpu.tgz -C /tmp/g .
set -uo pipefail
OUT="${OUT:-$PWD/gpu-out}"
mkdir -p "$OUT"
what="${1:-all}"
# one mode or several joined by commas (test,sanitize,floor,profile): one setup for all of them
has() { [[ ",$what," == *",$1,"* ]]; }
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0+PTX}" GRPO_EXT_CUDA=ON
start=$SECONDS
stage() { echo "=== $1 ($((SECONDS - start)) s)" | tee -a "$OUT/stages.txt"; }

stage setup
{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv
  python3 -c "import torch, sys; print(sys.version); print('torch', torch.__version__, 'cuda', torch.version.cuda)"
  nvcc --version | tail -2
} 2>&1 | tee "$OUT/build.txt"
if [[ -n "${WHEELS:-}" && -d "$WHEELS" ]]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$WHEELS"/*.whl 2>&1 | tail -3 | tee -a "$OUT/build.txt"
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
if [[ -n "${GRPO_EXT_WHEEL:-}" ]]; then
  python3 -m pip install -q --no-deps --force-reinstall "$GRPO_EXT_WHEEL" 2>&1 | tail -5 | tee -a "$OUT/build.txt"
else
  make build PYTHON_ENV=system 2>&1 | tail -20 | tee -a "$OUT/build.txt"
fi
(cd /tmp && python3 -c "import grpo_ext, json; info = grpo_ext.build_info(); print(json.dumps(info))
assert info['cuda_kernels_registered']
for name in ('liger_kernel', 'trl', 'triton'):
    try:
        module = __import__(name); print(name, getattr(module, '__version__', '?'))
    except Exception as exc:
        print(name, 'unavailable:', repr(exc)[:200])") 2>&1 | tee -a "$OUT/build.txt"
[[ "${PIPESTATUS[0]}" == 0 ]] || exit 1

if has all || has test; then
  stage "CUDA tests of mul_rounded (FMA contraction), first and by name"
  # The cases that failed on the H100 when nvcc contracted z - max (z = x * scale) into one FMA (RESULTS.md, "H100,
  # second call"), which mul_rounded (csrc/logit_transform.h) prevents: logits scaled by a temperature or
  # logit_scale != 1 (uncapped and capped) with a confident token, whose exp(z - max) must be exactly 1 at the max.
  # Only a GPU shows contraction (the emulated suite is built without it), so each is run and reported by name.
  fma_cases=()
  for vocab in 1 7 50257 151936; do
    fma_cases+=("tests/test_grpo_loss_from_logits.py::test_vocabulary_sizes_and_temperature[$vocab-cuda]")
  done
  for level in token sequence; do
    for options in 0.6-None 1.0-3.0 1.7-2.5; do
      fma_cases+=("tests/test_grpo_loss_from_logits.py::test_logit_scale_and_softcap_match_reference[$level-$options-cuda]")
    done
  done
  timeout 120 python3 -m pytest -v -p no:cacheprovider -rfEs "${fma_cases[@]}" 2>&1 \
    | grep -E "(PASSED|FAILED|ERROR|SKIPPED)|passed|failed|skipped|error|not found" | tee "$OUT/pytest-fma.txt"
  stage "CUDA tests"
  # the tests that run on the GPU (the emulated suite and verl's parity run on the CPU in CI)
  timeout 200 python3 -m pytest -q -p no:cacheprovider -n 8 -k cuda -rfs --ignore=tests/cuda_emu \
    --ignore=tests/test_verl_integration.py --ignore=tests/wheel tests 2>&1 | tail -30 | tee "$OUT/pytest.txt"
fi
if has all || has sanitize; then
  # single_read_and_two_read at V 32000 only: its tests carry the cuda keyword since 2026-11-28 (tests/conftest.py)
  # and had never run here; its clusters of 11-14 blocks at the longer rows would not fit racecheck's limit
  sel="cuda and (deterministic or large or group_ids_match or group_ids_of_different or masked_rows_never_read \
or error_at_most_twice or every_dtype or (single_read_and_two_read and 32000))"
  # racecheck took over 75 s on an H200 (2026-11-27) once the single-read clusters joined the selection
  for tool_limit in memcheck:75 racecheck:100; do
    tool="${tool_limit%%:*}"
    stage "compute-sanitizer $tool"
    timeout "${tool_limit##*:}" compute-sanitizer --tool "$tool" --error-exitcode 9 --print-limit 20 \
      python3 -m pytest -q -p no:cacheprovider -x -k "$sel" tests/test_group_advantages.py tests/test_grpo_loss.py \
      tests/test_grpo_loss_from_logits.py tests/test_grpo_loss_from_logits_edges.py tests/test_selective_log_softmax.py \
      2>&1 | tail -12 | tee "$OUT/sanitizer-$tool.txt"
    echo "compute-sanitizer $tool exit: ${PIPESTATUS[0]} (124: its time limit)" | tee -a "$OUT/sanitizer-$tool.txt"
  done
fi
if has all || has bench || has floor; then
  stage "bench_floor"
  # every layout candidate of the logits pass (bench_floor.LAYOUTS, small-blocks included: issue 38) at five shapes;
  # ~4 s per added candidate (benchmarks/NOTES.md, "The single-read pass in clusters of up to 16 small blocks")
  timeout 200 python3 benchmarks/bench_floor.py --out "$OUT/bench_floor.json" 2>&1 | tee "$OUT/bench_floor.txt"
fi
if has all || has bench || has micro; then
  # issue 38 item 4: group_ids within 2x of group_size at 524k rewards, the per-call overhead's prediction
  stage "bench_group_advantages"
  timeout 60 python3 benchmarks/bench_group_advantages.py --no-compile --out "$OUT/bench_group_advantages.json" \
    2>&1 | tee "$OUT/bench_group_advantages.txt"
  stage "bench_overhead"
  timeout 60 python3 benchmarks/bench_overhead.py --device cuda --sizes 64x1024x64 --host-profile \
    --out "$OUT/bench_overhead.json" \
    2>&1 | tee "$OUT/bench_overhead.txt"
fi
if has all || has bench; then
  stage "bench_trainer (Qwen2.5-0.5B's shape, random weights, as TRL ships the step: bf16, checkpointing)"
  # issue 39's first row, with where the time goes (--profile: the head + loss against its 3 GEMMs): TRL and TRL +
  # grpo_ext, ~45 s each on the H200 of 2026-11-27 (a third contender did not fit 150 s); grpo_ext's trainer and the
  # other rows are the `trainer` stage, a second call
  timeout 130 python3 benchmarks/bench_trainer.py --shape qwen2.5-0.5b --lengths 1024 --batch 8 --steps 3 \
    --precision bf16 --beta 0 --profile --memory-sites --no-generation --contenders trl,trl+grpo_ext/fused \
    --out "$OUT/bench_trainer.json" 2>&1 | tee "$OUT/bench_trainer.txt"
fi
if has compile; then
  # measured on the H200 of 2026-11-27 (15.2 ms, 12.9x the copy, at 8192 x 151936 bf16): no longer part of `all`
  stage "bench_floor with torch.compile of the reference (one shape: its compilation takes most of a minute)"
  timeout 120 python3 benchmarks/bench_floor.py --logits 8192x151936:bfloat16 --selective none --hidden none --compile \
    --out "$OUT/bench_floor_compile.json" 2>&1 | tee "$OUT/bench_floor_compile.txt"
fi
if has profile; then
  # Nsight Compute over one pass of each logits layout at 8192 x 151936 bf16 (benchmarks/ncu_logits_layouts.py):
  # achieved occupancy, DRAM throughput and warp stalls, to tell why the single-read layouts take their time
  # (NOTES.md, "The small-block layout on an H200"); works on the Firecracker machines (KINDS.md), not on gVisor
  stage "ncu over the logits layouts"
  (cd benchmarks && timeout 240 ncu --clock-control none --profile-from-start off \
    --kernel-name 'regex:^grpo_loss_from_logits_(small_block_|full_occupancy_)?kernel$' \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
    python3 ncu_logits_layouts.py) > "$OUT/ncu_logits_layouts.txt" 2>&1
  echo "ncu exit: $?" | tee -a "$OUT/ncu_logits_layouts.txt"
  # Each SASS instruction's executions and stall samples for the default and the small-block layout: where the
  # small-block kernel's ~27% more instructions than the two-read kernel's go (NOTES.md, "The logits loops on the
  # ncu counters"); read it with benchmarks/sass_loops.py's loop addresses
  stage "ncu source counters (default, small-blocks)"
  # into a report first, then its source page printed from it (--page source reads a report: one ncu version may
  # not print it while profiling), and the SourceCounters section's summary (branches, top stall sites)
  (cd benchmarks && timeout 150 ncu --clock-control none --profile-from-start off -f -o /tmp/ncu_source \
    --kernel-name 'regex:^grpo_loss_from_logits_(small_block_)?kernel$' --section SourceCounters \
    python3 ncu_logits_layouts.py --only default,grpo_ext/small-blocks) > "$OUT/ncu_source_run.txt" 2>&1
  echo "ncu source exit: $?" | tee -a "$OUT/ncu_logits_layouts.txt"
  timeout 60 ncu -i /tmp/ncu_source.ncu-rep --page source --csv --print-source sass > "$OUT/ncu_sass.csv" 2>&1
  timeout 60 ncu -i /tmp/ncu_source.ncu-rep --page details >> "$OUT/ncu_source_run.txt" 2>&1
  grep -E "profiled launch|grpo_loss_from_logits|Duration|DRAM Throughput|Achieved Occupancy|Theoretical Occupancy|Cluster|Registers|Waves" \
    "$OUT/ncu_logits_layouts.txt" | head -150
fi
if has trainer; then
  # issue 39's other rows, not part of `all` (one call of its own, at most 8 minutes; ~40-50 s per contender and
  # case): grpo_ext's trainer beside TRL + grpo_ext and TRL, Qwen2.5-0.5B at T 1024 and 4096 with beta 0.04 (a
  # reference model), Qwen2.5-1.5B at T 1024 with beta 0, as TRL ships the step, with the parts of each step
  # TRAINER_CASES (shape:length:beta ...) picks some of them
  for case in ${TRAINER_CASES:-qwen2.5-0.5b:1024:0.04 qwen2.5-0.5b:4096:0.04 qwen2.5-1.5b:1024:0}; do
    IFS=: read -r shape length beta <<<"$case"
    stage "bench_trainer $shape T $length beta $beta"
    # 200 s: the three contenders took 47 + 63 s and more at 1.5B (2026-11-27: 150 s stopped the third)
    timeout 200 python3 benchmarks/bench_trainer.py --shape "$shape" --lengths "$length" --batch 8 --steps 2 \
      --precision bf16 --beta "$beta" --profile --memory-sites --no-generation \
      --contenders grpo_ext/fused,trl,trl+grpo_ext/fused \
      --out "$OUT/bench_trainer-$shape-$length-$beta.json" 2>&1 | tee "$OUT/bench_trainer-$shape-$length-$beta.txt"
  done
fi
stage done
echo
echo "######## summary ($((SECONDS - start)) s)"
grep -h -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed|skipped|error|not found" "$OUT/pytest-fma.txt" 2>/dev/null
grep -h -E "passed|failed|error" "$OUT/pytest.txt" 2>/dev/null | tail -3
grep -h "exit:" "$OUT"/sanitizer-*.txt 2>/dev/null
grep -h -A14 "^case .* impl .* ms .* x eager" "$OUT/bench_group_advantages.txt" 2>/dev/null | head -40
tail -12 "$OUT/bench_overhead.txt" 2>/dev/null
tail -8 "$OUT"/bench_trainer*.txt 2>/dev/null
sed -n '/^median ms per call/,$p' "$OUT/bench_floor_compile.txt" 2>/dev/null | grep -E "compile|copy"
sed -n '/^median ms per call/,$p' "$OUT/bench_floor.txt" 2>/dev/null
