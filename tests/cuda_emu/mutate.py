"""The mutation check of cuda_emu: plants one known bug at a time in a copy of csrc/ (the kernel headers, and the host
plans of csrc/plan, which the driver runs as they are) and shows that the emulated-device tests (tests/cuda_emu) fail
on it. Not part of the default test run: each mutation rebuilds the driver (about a
minute on 2 cores) and runs the suite until its first failure.

    python tests/cuda_emu/mutate.py            # every mutation; prints a Markdown table
    python tests/cuda_emu/mutate.py --only 3 7 # some of them (by number)

Exit status 0 when every mutation expected to be caught was caught (and the unmutated headers pass).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from build import REPO, BuildError, build


@dataclasses.dataclass(frozen=True)
class Mutation:
    kind: str
    what: str
    file: str  # under csrc/
    old: str
    new: str
    expect_caught: bool = True


MUTATIONS = [
    Mutation("missing __syncthreads", "block_sum: no barrier between the warp partials and warp 0 reading them",
             "cuda/reduce.cuh", "  }\n  __syncthreads();\n  if (warp == 0) {", "  }\n  if (warp == 0) {"),
    Mutation("missing __syncthreads", "block_sum: no barrier before the scratch is reused (the trailing one)",
             "cuda/reduce.cuh", "  __syncthreads();  // the scratch may be reused right after\n", ""),
    Mutation("missing trailing barrier", "softmax forward: no barrier at the end of the grid-stride row loop",
             "cuda/selective_log_softmax.cuh", "    __syncthreads();  // warp_states is reused by the next row\n",
             ""),
    Mutation("off-by-one", "softmax backward: the strided-row loop runs to v <= vocab",
             "cuda/selective_log_softmax.cuh", "v < vocab; v += blockDim.x)\n        out[v] = to_out",
             "v <= vocab; v += blockDim.x)\n        out[v] = to_out"),
    Mutation("off-by-one", "group advantages: the member loop runs to i <= group_size",
             "cuda/group_advantages.cuh",
             "i < n; i += t.width) {\n      const int64_t row = a.groups.row(base + i);\n      const T r = combine",
             "i <= n; i += t.width) {\n      const int64_t row = a.groups.row(base + i);\n      const T r = combine"),
    Mutation("early reader", "group advantages: the second-to-last block to finish merges the tiles' batch moments",
             "cuda/group_advantages.cuh",
             "last_block = atomicAdd(a.blocks_done, 1) == static_cast<int>(gridDim.x) - 1;",
             "last_block = atomicAdd(a.blocks_done, 1) == static_cast<int>(gridDim.x) - 2;"),
    Mutation("unstable order", "group advantages: group_ids rows ranked with <=, so equal ranks collide",
             "cuda/group_rows.cuh", "rank += groups.placed[base + q] < row ? 1 : 0;",
             "rank += groups.placed[base + q] <= row ? 1 : 0;"),
    Mutation("wrong shuffle offset", "warp_sum: the shuffle tree starts at offset 8 (half the warp is lost)",
             "cuda/reduce.cuh", "for (int offset = 16; offset > 0; offset >>= 1) v +=",
             "for (int offset = 8; offset > 0; offset >>= 1) v +="),
    Mutation("barrier in a divergent branch", "block_merge: the barrier inside `if (lane == 0)`",
             "cuda/selective_log_softmax.cuh", "  if (lane == 0) warp_states[warp] = s;\n  __syncthreads();",
             "  if (lane == 0) {\n    warp_states[warp] = s;\n    __syncthreads();\n  }"),
    Mutation("partial shuffle mask", "kFullWarp leaves lane 31 out of every reduction's mask", "cuda/reduce.cuh",
             "constexpr unsigned kFullWarp = 0xffffffffu;", "constexpr unsigned kFullWarp = 0x7fffffffu;"),
    Mutation("undersized shared array", "loss rows: scratch for 7 sums where block_sum reduces 8",
             "cuda/grpo_loss.cuh", "__shared__ double scratch[(kNumRowSlots + 1) * 32];",
             "__shared__ double scratch[kNumRowSlots * 32];"),
    Mutation("wrong row offset", "logits pass: logits row r scores token r, not row_offset + r",
             "cuda/grpo_loss_from_logits_row.cuh", "const int64_t n = a.row_offset + r,", "const int64_t n = r,"),
    Mutation("dropped mask factor", "row weights: tokens counted without the sample mask",
             "cuda/grpo_loss_from_logits.cuh", "T m = in.mask_at<T>(b, t);", "T m = in.mask.load<T>(b, t);"),
    Mutation("over-sized launch", "loss rows: up to 1024 threads per row, over __launch_bounds__(256)",
             "cuda/grpo_loss.cuh", "want > 256 ? 256 : want", "want > 1024 ? 1024 : want"),
    Mutation("missing write", "loss rows: a chunk of masked tokens gets no gradient (the output keeps garbage)",
             "cuda/grpo_loss.cuh", "  if (grad_row) store_row_tokens", "  if (grad_row && kept) store_row_tokens"),
    Mutation("wrong grid stride", "scale_rows: the row loop strides by 1 instead of gridDim.x (rows scaled twice)",
             "cuda/grpo_loss_from_logits.cuh", "r < rows.rows; r += gridDim.x) {\n    Out* row",
             "r < rows.rows; r += 1) {\n    Out* row"),
    Mutation("missing cluster barrier", "single-read pass: no cluster barrier after the mbarriers' initialization (a "
             "peer may push into a block whose mbarrier does not exist yet)",
             "cuda/grpo_loss_from_logits_single_read.cuh",
             "  cluster_sync_mbarrier_init();  // no peer pushes", "  // no peer pushes"),
    Mutation("shared state reused too early", "single-read pass: one inbox slot for every row (a fast peer may push "
             "the next row's state over one not read yet)", "cuda/grpo_loss_from_logits_single_read.cuh",
             "    parity ^= 1u;\n", ""),
    Mutation("missing mbarrier wait", "single-read pass: the inbox read without waiting on its mbarrier (the peers' "
             "states not landed yet)", "cuda/grpo_loss_from_logits_single_read.cuh",
             "      mbarrier_wait(full, (phases >> parity) & 1u);\n", ""),
    Mutation("redundant barrier removed", "logits pass: no barrier at the end of the row loop (the next row's "
             "block_merge barrier already orders every shared access)", "cuda/grpo_loss_from_logits.cuh",
             "    __syncthreads();  // the shared row values are reused by the next row\n", "", expect_caught=False),
    Mutation("dropped guard", "softmax backward: a row with no upstream gradient gets 0 * its (NaN) gradient",
             "cuda/selective_log_softmax.cuh", "const bool inert = gl == T(0) && gh == T(0);",
             "const bool inert = false;"),
    Mutation("empty state taken for a real one", "add_logits: a thread's first vector rebased on the empty state's "
             "max 0 (exp(-115) = 0 terms)", "cuda/selective_log_softmax.cuh",
             "if (top > s.max || (s.sum == T(0) && top > -INFINITY)) {", "if (top > s.max) {"),
    Mutation("lost carry", "group_ids offsets: each batch of tiles scanned from 0 (the rows of the batches before "
             "forgotten)", "cuda/group_rows.cuh",
             "  int carry = 0;  // the counts of the tiles before\n  for (int64_t base = 0; base < num_groups; "
             "base += int64_t(kScanBatch) * blockDim.x) {\n",
             "  for (int64_t base = 0; base < num_groups; base += int64_t(kScanBatch) * blockDim.x) {\n"
             "  int carry = 0;\n"),
    Mutation("0 * -inf", "logits pass: the entropy bonus's term takes a -inf logit's d as is (0 * -inf = NaN)",
             "cuda/grpo_loss_from_logits_row.cuh",
             "fma(e_slope * p, (fmax(d, std::numeric_limits<T>::lowest()) - mean_shift), value)",
             "fma(e_slope * p, (d - mean_shift), value)"),
    Mutation("lost rows", "kept entropy mean: each warp's second row skipped (a batch of more rows than warps)",
             "cuda/kept_entropy.cuh", "b += num_warps", "b += 2 * num_warps"),
    Mutation("weights ignored", "kept entropy mean: the bonus takes the plain mean where entropy_weights were given",
             "cuda/kept_entropy.cuh", "entropy_means(sums, entropy_weights.present())", "entropy_means(sums, false)"),
    Mutation("dropped rows", "row weights: skip_empty_rows counts only the rows of more than one kept token",
             "cuda/grpo_loss_from_logits.cuh", "total[1] += row_weight[b] > T(0) ? 1.0 : 0.0;",
             "total[1] += row_weight[b] > T(1) ? 1.0 : 0.0;"),
    Mutation("dropped rows", "loss rows: the non-empty slot (skip_empty_rows) is 1 only for more than one kept token",
             "cuda/grpo_loss.cuh", "row_sum[kSlotNonEmpty] = row_sum[kSlotMask] > 0.0 ? 1.0 : 0.0;",
             "row_sum[kSlotNonEmpty] = row_sum[kSlotMask] > 1.0 ? 1.0 : 0.0;"),
    Mutation("lost lane", "vector_max (bf16): the packed max's high lane dropped (the odd elements' max)",
             "cuda/vector_io.cuh",
             "__hmax2(pairs[2], pairs[3]));\n  return fmaxf(__low2float(top), __high2float(top));\n}\ntemplate <>\n"
             "__device__ __forceinline__ float vector_max<float, __half>",
             "__hmax2(pairs[2], pairs[3]));\n  return __low2float(top);\n}\ntemplate <>\n"
             "__device__ __forceinline__ float vector_max<float, __half>"),
    Mutation("wrong row stride", "logits pass (two-read): a new gradient's row written at the logits' row offset",
             "cuda/grpo_loss_from_logits.cuh",
             "the thread that writes it).\n    In* grad_row = a.compute_grad ? (a.grad_in_logits ? grad + "
             "a.logits.offset(r) : grad + r * vocab)",
             "the thread that writes it).\n    In* grad_row = a.compute_grad ? (a.grad_in_logits ? grad + "
             "a.logits.offset(r) : grad + a.logits.offset(r))"),
    Mutation("wrong row stride", "single-read pass: a new gradient's row written at the logits' row offset",
             "cuda/grpo_loss_from_logits_single_read.cuh",
             "grad + r * vocab) : nullptr;\n    if (row.m == T(0)) {  // the same branch",
             "grad + a.logits.offset(r)) : nullptr;\n    if (row.m == T(0)) {  // the same branch"),
    # The host plan of the whole op (plan/logits_loss.h), which the driver runs as it is.
    Mutation("skipped launch", "logits_loss: a sequence-level loss's second pass (which writes the gradient) not run",
             "plan/logits_loss.h", "    device.pass(second, inplace);\n", ""),
    Mutation("wrong scale", "logits_loss: the entropy bonus taken off the loss without loss_scale",
             "logits_loss_math.h", "return entropy_coef == T(0) ? T(0) : entropy_coef * loss_scale;",
             "return entropy_coef == T(0) ? T(0) : entropy_coef;"),
    Mutation("wrong level", "logits_loss: the loss of the pass's log-probs planned per token whatever the option",
             "plan/logits_loss.h",
             "plan.params.sequence_level = parse_sequence_level(options.importance_sampling_level);",
             "plan.params.sequence_level = false;"),
    # The single-read pass's cluster merge and handshake (clusters of up to 16 blocks, test_logits_small_blocks.py),
    # and its part bounds.
    Mutation("skipped rank", "single-read merge: the cluster's last block's state left out of the row's",
             "cuda/grpo_loss_from_logits_single_read.cuh", "lane < blocks ? sh.inbox[parity][lane].state",
             "lane + 1 < blocks ? sh.inbox[parity][lane].state"),
    Mutation("order differing per block", "single-read merge: each block merges the states in an order rotated by "
             "its rank (the blocks' row statistics differ in their last bits)",
             "cuda/grpo_loss_from_logits_single_read.cuh",
             "blocks ? sh.inbox[parity][lane].state :", "blocks ? sh.inbox[parity][(lane + rank) % blocks].state :"),
    Mutation("wrong parity", "single-read merge: the peers' states read from the other row's slot",
             "cuda/grpo_loss_from_logits_single_read.cuh", "blocks ? sh.inbox[parity][lane].state :",
             "blocks ? sh.inbox[parity ^ 1u][lane].state :"),
    Mutation("bytes miscounted", "mbarrier handshake: each block announces one state too few (its phase may complete "
             "before the last state lands, which then lands in the next phase)",
             "cuda/grpo_loss_from_logits_single_read.cuh",
             "mbarrier_arrive_expect_tx(full, blocks * unsigned(sizeof(PartState<T>)));",
             "mbarrier_arrive_expect_tx(full, (blocks - 1) * unsigned(sizeof(PartState<T>)));"),
    Mutation("off-by-one", "single-read pass: each block's part one element longer than its slice (parts overlap)",
             "cuda/grpo_loss_from_logits_single_read.cuh", "(vocab - lo < slice ? vocab - lo : slice) : 0;",
             "(vocab - lo < slice ? vocab - lo : slice + 1) : 0;"),
    Mutation("read before the copy lands", "single-read staging: the part's statistics read from shared memory "
             "before async_copy_wait_all (a row's stale or unwritten bytes)", "cuda/vector_io.cuh",
             "  async_copy_wait_all();\n  for_each_vector(static_cast<const Vector<In>*>(body), vectors, "
             "[&](int64_t, const Vector<In>& in) { chunk(in); });",
             "  for_each_vector(static_cast<const Vector<In>*>(body), vectors, "
             "[&](int64_t, const Vector<In>& in) { chunk(in); });\n  async_copy_wait_all();"),
    Mutation("off-by-one", "single-read staging: the asynchronous copies stop one vector short of the body",
             "cuda/vector_io.cuh", "for (int64_t i = threadIdx.x; i < vectors; i += blockDim.x) async_copy_16",
             "for (int64_t i = threadIdx.x; i + 1 < vectors; i += blockDim.x) async_copy_16"),
    Mutation("wrong index", "softmax backward: the chosen-token test ignores the element's place in its vector",
             "cuda/vector_io.cuh",
             "return static_cast<uint64_t>(offset) < 16 && static_cast<int>(offset) == k;", "return offset == 0;"),
    Mutation("lost prefix", "group_ids offsets: each thread's run placed after the batches before, not after the "
             "runs before it in its batch", "cuda/group_rows.cuh",
             "int start = carry + block_inclusive_scan(run, scratch, batch_total) - run;",
             "int start = carry + 0 * block_inclusive_scan(run, scratch, batch_total);"),
    Mutation("wrong index", "softmax backward: the chosen token's onehot on the element after it",
             "cuda/selective_log_softmax.cuh", "select_computed(v.is(id), gl, T(0))",
             "select_computed(v.is(id + 1), gl, T(0))"),
    # The single-read pass's mbarrier handshake (cluster_push into each block's inbox; test_logits_small_blocks.py).
    Mutation("wrong phase", "mbarrier handshake: every wait on an inbox slot's first phase (a slot's third use passes "
             "before its states land)", "cuda/grpo_loss_from_logits_single_read.cuh",
             "mbarrier_wait(full, (phases >> parity) & 1u);", "mbarrier_wait(full, 0u);"),
    Mutation("wrong sender slot", "mbarrier handshake: each block pushes its state into the receiver's own slot, not "
             "its sender's (the states overwrite each other)", "cuda/grpo_loss_from_logits_single_read.cuh",
             "cluster_push(&sh.inbox[parity][rank], lane,", "cluster_push(&sh.inbox[parity][lane], lane,"),
    Mutation("wrong part", "single-read pass: the chosen token's logit taken from this block's push, not from the "
             "part that holds it", "cuda/grpo_loss_from_logits_single_read.cuh",
             "sh.inbox[parity][id / slice].chosen_logit", "sh.inbox[parity][rank].chosen_logit"),
    # The logits gradient's chosen entry, written after the loop by the thread that wrote it (write_row_grad_with).
    Mutation("wrong writer", "logits gradient: thread 0 writes the chosen entry, racing with the thread whose loop "
             "wrote it", "cuda/vector_io.cuh", "return turn % blockDim.x == threadIdx.x;",
             "return turn * 0 == threadIdx.x;"),
    Mutation("wrong writer", "logits gradient: the chosen entry's writer counted by elements, not by vectors, in the "
             "row's body", "cuda/vector_io.cuh", "index < body_end ? (index - head) / W :",
             "index < body_end ? (index - head) :"),
    Mutation("lost entry", "logits gradient: the chosen entry left at the loop's -g * p",
             "cuda/grpo_loss_from_logits_row.cuh", "if (id >= 0 && id < n && writes_element(x, n, id)) out[id]",
             "if (id >= n && writes_element(x, n, id)) out[id]"),
    # d = z - max taken one way for a whole row (LogitTransform::d_with: one FMA without a cap), the H100's failure
    # of 2026-11-26 when nvcc mixed the FMA and the rounded product in one row (RESULTS.md, "H100, second call").
    Mutation("mixed d", "logits pass: the chosen token's d as the rounded z minus the max, its row's statistics by "
             "the FMA", "cuda/grpo_loss_from_logits_row.cuh", "d = f.d_at(chosen.logit, s.max);",
             "d = f(chosen.logit) - s.max;"),
    Mutation("mixed d", "logits gradient: d as the rounded z minus the max, the statistics by the FMA",
             "cuda/grpo_loss_from_logits_row.cuh", "const T d = f.template d_with<kCap>(logit, z_max);",
             "const T d = f.template z_with<kCap>(logit) - z_max;"),
    # docs/math.md section 8, "An overflowing ratio": a zero dP/drho times an overflowed rho is 0, not NaN.
    Mutation("0 * inf", "loss kernel: the gradient through an overflowed ratio as dP/drho * rho (NaN where a clipped "
             "token's dP/drho is 0)", "cuda/grpo_loss.cuh", "w * token_level_grad(tt, rho)",
             "w * (tt.token_dl + tt.token_drho * rho)"),
    Mutation("0 * inf", "logits pass: a token's dP/dl through an overflowed ratio as dP/drho * rho",
             "logits_loss_math.h", "return token_level_grad(tt, rho);", "return tt.token_dl + tt.token_drho * rho;"),
    Mutation("launch over the bound", "logits pass: the full-occupancy build (__launch_bounds__(256, 8)) launched with "
             "blocks of more than 256 threads", "cuda/grpo_loss_from_logits.cuh",
             "if (device.full_occupancy && threads <= 256) {", "if (device.full_occupancy) {"),
    Mutation("host value", "a number given as a device tensor (loss_scale, num_items_in_batch) not read by the kernel",
             "grpo_loss_params.h", "return device != nullptr ? double(device[0]) : value;", "return value;"),
    # A row that fits one block: its own kernel, which pushes nothing (st.async into a one-block cluster is undefined).
    Mutation("one-block cluster", "logits pass: one-block rows launched on the clusters' kernel (it pushes its "
             "state to itself)", "cuda/grpo_loss_from_logits_single_read.cuh",
             "  if (blocks == 1) {\n    return launch_single", "  if (blocks == 0) {\n    return launch_single"),
    Mutation("one-block cluster", "logits pass: the lone-block kernel compiled with the clusters' exchange",
             "cuda/grpo_loss_from_logits_single_read.cuh", "single_read_pass<false>(", "single_read_pass<true>("),
    # docs/math.md section 8: the bias-corrected k3 term's KL + dKL/dl is -r in closed form, not a cancellation.
    Mutation("cancellation", "loss kernels: the bias-corrected k3 term's KL + dKL/dl formed as (exp(r) - r - 1) + (1 - "
             "exp(r))", "grpo_loss_math.h", "out.kl_and_slope = passes ? -r : kl;",
             "out.kl_and_slope = kl + out.dkl_dl;"),
    # docs/math.md section 8: at the sequence level the bias-corrected KL's own path and the row's ratio path are one
    # factor of the row's ratio, not two products that meet as inf - inf.
    Mutation("inf - inf", "loss kernel: the sequence level's own KL path and the row's ratio path multiplied by the "
             "row's ratio apart", "cuda/grpo_loss.cuh",
             "g[k] += through_ratio_exp(m[k] * row_drho + own, seq_ratio);",
             "g[k] += through_ratio_exp(m[k] * row_drho, seq_ratio) + own * seq_ratio;"),
    Mutation("inf - inf", "loss terms: the bias-corrected KL's loss multiplied by rho apart from the policy term's",
             "grpo_loss_math.h", "      loss_factor += c.beta * k.kl;\n", "      out.loss += c.beta * out.kl;\n"),
    Mutation("cancellation", "loss kernel: a sequence-level row of one kept token summed with the general form (k3's "
             "KL + dKL/dl as the cancelling sum)", "cuda/grpo_loss.cuh",
             "acc[kNumRowSlots] += w * (lone_row ? tt.token_drho : tt.dloss_drho);",
             "acc[kNumRowSlots] += w * tt.dloss_drho;"),
]  # fmt: skip

# What stopped the suite, most specific first: (pattern, how to say it).
_EVIDENCE = [
    (r"AddressSanitizer: ([\w-]+)", "ASan: {0}"),
    (r"runtime error: ([^\n]{0,80})", "UBSan: {0}"),
    (r"divergent __syncthreads", "divergent __syncthreads"),
    (r"exited while other threads of its block wait", "thread exited while its block waits at a barrier"),
    (r"divergent warp intrinsics", "divergent warp intrinsics"),
    (r"deadlock", "deadlock"),
    (r"before a cluster barrier followed its initialization", "push before the cluster saw the mbarrier"),
    (r"exited with phase \d+ of its mbarrier begun", "block exited mid-phase of its mbarrier"),
    (r"landed in block rank \d+ after all of its threads exited", "push landed in an exited block"),
    (r"reads lane \d+, which is (outside|not participating)", "shuffle reads a lane {0} its mask"),
    (r"does not name it", "lane calls a shuffle whose mask excludes it"),
    (r"__launch_bounds__\((\d+)\)", "launch over __launch_bounds__({0})"),
    (r"differs between the ([\w-]+) and ([\w-]+) schedules", "{0} and {1} schedules disagree"),
    (r"device assert failed", "device assert"),
    (r"(\w+) (output \d+|[a-z_]+): Tensor-likes are not close!\s+Mismatched elements: (\d+ / \d+)",
     "{1} differs from the CPU kernel ({2} elements)"),
    (r"Mismatched elements: (\d+ / \d+)", "differs from the CPU kernel ({0} elements)"),
]  # fmt: skip


def evidence(output: str) -> str:
    failed = re.search(r"^FAILED (\S+)", output, re.M) or re.search(r"^ERROR (\S+)", output, re.M)
    where = failed.group(1).split("::", 1)[-1] if failed else "?"
    for pattern, text in _EVIDENCE:
        m = re.search(pattern, output)
        if m:
            return f"{text.format(*m.groups())}, in {where}"
    return f"failed: {where}"


def build_dir(csrc: Path) -> Path:
    """Where a mutant's driver is built: beside its copy of csrc/ (removed with it), not in the repository's cache."""
    return csrc.parent / "build" if csrc != REPO / "csrc" else REPO / "build" / "cuda_emu"


def run_suite(csrc: Path) -> tuple[bool, str]:
    """Runs tests/cuda_emu on ``csrc`` until the first failure; returns (passed, pytest's output)."""
    env = {**os.environ, "GRPO_EMU_CSRC": str(csrc), "GRPO_EMU_BUILD": str(build_dir(csrc))}
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "tests/cuda_emu"]
    result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    return result.returncode == 0, result.stdout + result.stderr


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", type=int, nargs="*", help="mutation numbers (1-based)")
    args = parser.parse_args()
    chosen = [(i, m) for i, m in enumerate(MUTATIONS, 1) if not args.only or i in args.only]
    passed, output = run_suite(REPO / "csrc")
    if not passed:
        print("the unmutated headers fail the suite:\n" + output[-3000:])
        return 1
    rows, ok = [], True
    for number, m in chosen:
        start = time.time()
        with tempfile.TemporaryDirectory(prefix="cuda_emu_mutant_") as tmp:
            csrc = Path(tmp) / "csrc"
            shutil.copytree(REPO / "csrc", csrc)
            path = csrc / m.file
            text = path.read_text()
            if text.count(m.old) != 1:
                raise SystemExit(f"mutation {number}: the text to replace occurs {text.count(m.old)} times in {m.file}")
            path.write_text(text.replace(m.old, m.new))
            try:
                build(csrc, build_dir(csrc))
            except BuildError as e:
                rows.append((number, m, "does not compile", str(e).splitlines()[1][:80], time.time() - start))
                ok = False
                continue
            passed, output = run_suite(csrc)
        caught = not passed
        ok &= caught or not m.expect_caught
        verdict = ("caught" if caught else "survived") + ("" if m.expect_caught else " (expected to survive)")
        rows.append((number, m, verdict, evidence(output) if caught else "-", time.time() - start))
        print(f"[{number}] {m.kind}: {verdict}", file=sys.stderr)
    print("| # | kind of bug | planted in | result | first report |")
    print("| --- | --- | --- | --- | --- |")
    for number, m, verdict, how, seconds in rows:
        print(f"| {number} | {m.kind} | {m.file}: {m.what} | {verdict} ({seconds:.0f} s) | {how} |")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
