// The loss's parameters and inputs as the kernels and the host plan see them (docs/math.md sections 3-7): the slots
// of the per-row sums and of the metrics, the options (LossParams), the strided inputs (LossInputs), a number the
// host may not read (DeviceNumber), and the two run-time choices that shape the per-token code (PolicyFamily,
// KLKind). The per-token math on them is grpo_loss_math.h; csrc/plan/loss_options.h fills them from the op's
// arguments.
#pragma once

#include "common.h"

namespace grpo_ext {
// Slots of the per-row partial sums that the kernels reduce into the loss and metrics.
// kSlotPhi: vespo's sum_t m * phi, or its phi alone with one advantage per row (0 for the other loss types).
enum RowSlot : int {
  kSlotLoss = 0,
  kSlotMask,
  kSlotKL,
  kSlotLow,
  kSlotHigh,
  kSlotRegion,
  kSlotCispo,
  kSlotPhi,
  kSlotNonEmpty,  // 1 for a row with a kept token (skip_empty_rows' row count)
  kNumRowSlots
};
// Order of the metrics vector returned by the forward op.
enum MetricSlot : int {
  kMetricKL = 0,
  kMetricLow,
  kMetricHigh,
  kMetricRegion,
  kMetricCispo,
  kMetricVespoPhi,
  kNumMetrics
};

// A number of the loss that the host may not read: `value`, or device[0] when `device` is set (a one-element tensor
// on the op's device, in the accumulate type: num_items_in_batch or loss_scale given as a CUDA tensor, which the
// kernel reads so that the op never syncs the host with the device).
template <typename T>
struct DeviceNumber {
  double value = 0.0;
  const T* device = nullptr;
  GRPO_HD double get() const { return device != nullptr ? double(device[0]) : value; }
};

struct LossParams {
  LossType loss_type = LossType::kGRPO;
  KLEstimator kl_estimator = KLEstimator::kK3;
  double epsilon_low = 0.2;
  double epsilon_high = 0.2;  // for cispo: the absolute cap on rho
  bool has_delta = false;
  double delta = 0.0;
  double beta = 0.0;
  bool has_kl_clamp = false;
  double kl_clamp = 0.0;
  bool bias_correction = false;
  bool sequence_level = false;
  bool row_share_metrics = false;  // sequence level with one advantage per row: clip shares are shares of rows
  bool has_old = false;
  double sapo_tau_pos = 1.0;
  double sapo_tau_neg = 1.05;
  double vespo_k_pos = 2.0, vespo_lambda_pos = 3.0, vespo_k_neg = 3.0, vespo_lambda_neg = 2.0;
  bool per_row_advantages = false;  // [B] advantages: vespo's phi metric is then a mean over rows
  bool skip_empty_rows = false;     // the per-row means count only rows with a kept token (verl's seq-mean-*)
  bool compute_grad = true;
};

// The loss op's inputs as strided views; absent optional inputs have data == nullptr.
struct LossInputs {
  StridedMatrix logps, old_logps, ref_logps, advantages, is_weights, mask, sample_mask;
  StridedMatrix policy_weights;  // multiply the policy term only, never vespo's w_i (docs/math.md section 3)
  int64_t batch = 0;
  int64_t seq_len = 0;

  // m_eff = completion_mask * sample_mask (docs/math.md section 3).
  template <typename T>
  GRPO_HD T mask_at(int64_t row, int64_t col) const {
    T m = mask.load<T>(row, col);
    if (sample_mask.present()) m *= sample_mask.load<T>(row, 0);
    return m;
  }
};

// Only 'grpo' and 'sapo' normalize each row by its own length.
GRPO_HD bool per_row_normalized(LossType t) {
  return t == LossType::kGRPO || t == LossType::kSAPO;
}

// The policy term's shape, and the KL estimator (kNone when beta == 0): the two choices that change the per-token
// code. Kernels dispatch on them once, so the token loop is straight-line code (vectorized on the CPU).
enum class PolicyFamily : int32_t { kClip = 0, kCispo, kSapo, kVespo };
enum class KLKind : int32_t { kNone = 0, kK1, kK2, kK3, kAbs, kK1Plus, kK3Plus, kLowVarKL };

GRPO_HD PolicyFamily policy_family(LossType t) {
  switch (t) {
    case LossType::kCISPO: return PolicyFamily::kCispo;
    case LossType::kSAPO: return PolicyFamily::kSapo;
    case LossType::kVESPO: return PolicyFamily::kVespo;
    default: return PolicyFamily::kClip;
  }
}
GRPO_HD KLKind kl_kind(const LossParams& p) {
  if (p.beta == 0.0) return KLKind::kNone;
  switch (p.kl_estimator) {
    case KLEstimator::kK1: return KLKind::kK1;
    case KLEstimator::kK2: return KLKind::kK2;
    case KLEstimator::kAbs: return KLKind::kAbs;
    case KLEstimator::kK1Plus: return KLKind::kK1Plus;
    case KLEstimator::kK3Plus: return KLKind::kK3Plus;
    case KLEstimator::kLowVarKL: return KLKind::kLowVarKL;
    default: return KLKind::kK3;
  }
}

}  // namespace grpo_ext
