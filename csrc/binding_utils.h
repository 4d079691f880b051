// Host-side glue shared by the CPU and CUDA bindings: input checks (TORCH_CHECK, naming the argument), torch
// tensor -> StridedMatrix views, option parsing, and output allocation. Kernels never see a torch type.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/string_view.h>

#include <optional>
#include <string>
#include <tuple>

#include "advantages_math.h"
#include "common.h"
#include "loss_math.h"

namespace grpo_ext {

inline bool is_float_type(at::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kBFloat16 || t == at::kHalf;
}

inline DType dtype_tag(at::ScalarType t, const char* name) {
  switch (t) {
    case at::kFloat: return DType::kFloat32;
    case at::kDouble: return DType::kFloat64;
    case at::kBFloat16: return DType::kBFloat16;
    case at::kHalf: return DType::kFloat16;
    case at::kBool: return DType::kBool;
    case at::kByte: return DType::kUInt8;
    case at::kChar: return DType::kInt8;
    case at::kInt: return DType::kInt32;
    case at::kLong: return DType::kInt64;
    default: TORCH_CHECK(false, name, ": unsupported dtype ", t);
  }
  return DType::kFloat32;
}

inline void check_float(const at::Tensor& t, const char* name) {
  TORCH_CHECK(is_float_type(t.scalar_type()), name,
              " must be a floating-point tensor (float32, float64, bfloat16 or float16), got ", t.scalar_type());
}

inline void check_same_device(const at::Tensor& t, const at::Tensor& like, const char* name, const char* like_name) {
  TORCH_CHECK(t.device() == like.device(), name, " must be on the same device as ", like_name, " (", like.device(),
              "), got ", t.device());
}

// A [rows, cols] view of `t`, which may be [rows, cols], [rows, 1] or [rows] (the last two broadcast over cols).
inline StridedMatrix matrix_view(const at::Tensor& t, int64_t rows, int64_t cols, const char* name,
                                 bool allow_row_vector) {
  StridedMatrix v;
  v.data = t.data_ptr();
  v.dtype = dtype_tag(t.scalar_type(), name);
  if (t.dim() == 2 && t.size(0) == rows && t.size(1) == cols) {
    v.row_stride = t.stride(0);
    v.col_stride = cols == 1 ? 0 : t.stride(1);
    return v;
  }
  TORCH_CHECK(allow_row_vector, name, " must have shape [", rows, ", ", cols, "], got ", t.sizes());
  const bool row_vector = (t.dim() == 1 && t.size(0) == rows) || (t.dim() == 2 && t.size(0) == rows && t.size(1) == 1);
  TORCH_CHECK(row_vector, name, " must have shape [", rows, "], [", rows, ", 1] or [", rows, ", ", cols, "], got ",
              t.sizes());
  v.row_stride = t.stride(0);
  v.col_stride = 0;
  return v;
}

inline std::string to_string(c10::string_view s) { return std::string(s.data(), s.size()); }

inline LossType parse_loss_type(c10::string_view s) {
  const std::string v = to_string(s);
  if (v == "grpo") return LossType::kGRPO;
  if (v == "bnpo") return LossType::kBNPO;
  if (v == "dr_grpo") return LossType::kDrGRPO;
  if (v == "dapo") return LossType::kDAPO;
  if (v == "luspo") return LossType::kLUSPO;
  if (v == "cispo") return LossType::kCISPO;
  if (v == "sapo") return LossType::kSAPO;
  TORCH_CHECK(false, "loss_type must be one of grpo, bnpo, dr_grpo, dapo, luspo, cispo, sapo; got '", v, "'");
  return LossType::kGRPO;
}

inline KLEstimator parse_kl_estimator(c10::string_view s) {
  const std::string v = to_string(s);
  if (v == "k1") return KLEstimator::kK1;
  if (v == "k2") return KLEstimator::kK2;
  if (v == "k3") return KLEstimator::kK3;
  TORCH_CHECK(false, "kl_estimator must be one of k1, k2, k3; got '", v, "'");
  return KLEstimator::kK3;
}

inline bool parse_sequence_level(c10::string_view s) {
  const std::string v = to_string(s);
  TORCH_CHECK(v == "token" || v == "sequence", "importance_sampling_level must be 'token' or 'sequence'; got '", v,
              "'");
  return v == "sequence";
}

inline ScaleRewards parse_scale_rewards(c10::string_view s) {
  const std::string v = to_string(s);
  if (v == "group") return ScaleRewards::kGroup;
  if (v == "batch") return ScaleRewards::kBatch;
  if (v == "none") return ScaleRewards::kNone;
  TORCH_CHECK(false, "scale_rewards must be one of group, batch, none; got '", v, "'");
  return ScaleRewards::kGroup;
}

inline Baseline parse_baseline(c10::string_view s) {
  const std::string v = to_string(s);
  if (v == "mean") return Baseline::kMean;
  if (v == "leave_one_out") return Baseline::kLeaveOneOut;
  TORCH_CHECK(false, "baseline must be 'mean' or 'leave_one_out'; got '", v, "'");
  return Baseline::kMean;
}

inline Aggregation parse_aggregation(c10::string_view s) {
  const std::string v = to_string(s);
  if (v == "sum_then_normalize") return Aggregation::kSumThenNormalize;
  if (v == "normalize_then_sum") return Aggregation::kNormalizeThenSum;
  TORCH_CHECK(false, "multi_objective_aggregation must be 'sum_then_normalize' or 'normalize_then_sum'; got '", v,
              "'");
  return Aggregation::kSumThenNormalize;
}

// Statistics are float64 for float64 inputs and float32 otherwise (spec: float32 accumulation at least).
inline at::ScalarType accumulate_type(at::ScalarType t) { return t == at::kDouble ? at::kDouble : at::kFloat; }

// ---------------------------------------------------------------------------------------------------------------
// group_advantages
// ---------------------------------------------------------------------------------------------------------------

#define GRPO_GROUP_ADVANTAGES_PARAMS                                                                              \
  const at::Tensor &rewards, const std::optional<at::Tensor>&reward_weights, int64_t group_size,                  \
      c10::string_view scale_rewards, c10::string_view baseline, c10::string_view multi_objective_aggregation,    \
      double eps, int64_t std_ddof
#define GRPO_GROUP_ADVANTAGES_ARGS \
  rewards, reward_weights, group_size, scale_rewards, baseline, multi_objective_aggregation, eps, std_ddof

using GroupAdvantagesResult = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

struct GroupAdvantagesPlan {
  AdvantageParams params;
  StridedMatrix rewards, weights;
  int64_t batch = 0, num_groups = 0;
  at::Tensor advantages, group_mean, group_std, zero_std;
  GroupAdvantagesResult result() const { return {advantages, group_mean, group_std, zero_std}; }
};

inline GroupAdvantagesPlan plan_group_advantages(GRPO_GROUP_ADVANTAGES_PARAMS) {
  check_float(rewards, "rewards");
  TORCH_CHECK(rewards.dim() == 1 || rewards.dim() == 2, "rewards must have shape [B] or [B, K], got ",
              rewards.sizes());
  TORCH_CHECK(group_size >= 1, "group_size must be >= 1, got ", group_size);
  TORCH_CHECK(std_ddof >= 0, "std_ddof must be >= 0, got ", std_ddof);
  TORCH_CHECK(eps >= 0, "eps must be >= 0, got ", eps);
  const int64_t batch = rewards.size(0);
  TORCH_CHECK(batch % group_size == 0, "rewards.shape[0]=", batch, " is not divisible by group_size=", group_size);
  GroupAdvantagesPlan plan;
  plan.batch = batch;
  plan.num_groups = batch / group_size;
  const int64_t k = rewards.dim() == 2 ? rewards.size(1) : 1;
  TORCH_CHECK(k >= 1, "rewards must have at least one column, got shape ", rewards.sizes());
  plan.params.group_size = group_size;
  plan.params.num_rewards = k;
  plan.params.scale = parse_scale_rewards(scale_rewards);
  plan.params.baseline = parse_baseline(baseline);
  plan.params.aggregation = parse_aggregation(multi_objective_aggregation);
  plan.params.eps = eps;
  plan.params.std_ddof = std_ddof;
  plan.rewards.data = rewards.data_ptr();
  plan.rewards.dtype = dtype_tag(rewards.scalar_type(), "rewards");
  plan.rewards.row_stride = rewards.stride(0);
  plan.rewards.col_stride = rewards.dim() == 2 ? rewards.stride(1) : 0;
  if (reward_weights.has_value()) {
    const at::Tensor& w = *reward_weights;
    check_float(w, "reward_weights");
    check_same_device(w, rewards, "reward_weights", "rewards");
    TORCH_CHECK(w.dim() == 1 && w.size(0) == k, "reward_weights must have K=", k, " entries, got shape ", w.sizes());
    plan.weights.data = w.data_ptr();
    plan.weights.dtype = dtype_tag(w.scalar_type(), "reward_weights");
    plan.weights.row_stride = 0;
    plan.weights.col_stride = w.stride(0);
  }
  const auto opts = rewards.options().dtype(accumulate_type(rewards.scalar_type()));
  plan.advantages = at::empty({batch}, opts);
  plan.group_mean = at::empty({plan.num_groups}, opts);
  plan.group_std = at::empty({plan.num_groups}, opts);
  plan.zero_std = at::empty({plan.num_groups}, opts.dtype(at::kBool));
  return plan;
}

// ---------------------------------------------------------------------------------------------------------------
// process_advantages
// ---------------------------------------------------------------------------------------------------------------

#define GRPO_PROCESS_ADVANTAGES_PARAMS                                                                  \
  const at::Tensor &step_rewards, const at::Tensor &step_end, int64_t group_size, int64_t seq_len, double eps, \
      int64_t std_ddof
#define GRPO_PROCESS_ADVANTAGES_ARGS step_rewards, step_end, group_size, seq_len, eps, std_ddof

struct ProcessAdvantagesPlan {
  StridedMatrix rewards, step_end;
  int64_t batch = 0, num_steps = 0, group_size = 1, seq_len = 0, std_ddof = 1;
  double eps = 1e-4;
  at::Tensor advantages;
};

inline ProcessAdvantagesPlan plan_process_advantages(GRPO_PROCESS_ADVANTAGES_PARAMS) {
  check_float(step_rewards, "step_rewards");
  TORCH_CHECK(step_rewards.dim() == 2, "step_rewards must have shape [B, S], got ", step_rewards.sizes());
  TORCH_CHECK(step_end.scalar_type() == at::kLong || step_end.scalar_type() == at::kInt,
              "step_end must be an int64 (or int32) tensor, got ", step_end.scalar_type());
  TORCH_CHECK(step_end.sizes() == step_rewards.sizes(), "step_end must have the shape of step_rewards ",
              step_rewards.sizes(), ", got ", step_end.sizes());
  check_same_device(step_end, step_rewards, "step_end", "step_rewards");
  TORCH_CHECK(group_size >= 1, "group_size must be >= 1, got ", group_size);
  TORCH_CHECK(seq_len >= 0, "seq_len must be >= 0, got ", seq_len);
  TORCH_CHECK(std_ddof >= 0, "std_ddof must be >= 0, got ", std_ddof);
  TORCH_CHECK(eps >= 0, "eps must be >= 0, got ", eps);
  ProcessAdvantagesPlan plan;
  plan.batch = step_rewards.size(0);
  TORCH_CHECK(plan.batch % group_size == 0, "step_rewards.shape[0]=", plan.batch,
              " is not divisible by group_size=", group_size);
  plan.num_steps = step_rewards.size(1);
  plan.group_size = group_size;
  plan.seq_len = seq_len;
  plan.std_ddof = std_ddof;
  plan.eps = eps;
  plan.rewards = matrix_view(step_rewards, plan.batch, plan.num_steps, "step_rewards", false);
  plan.step_end = matrix_view(step_end, plan.batch, plan.num_steps, "step_end", false);
  plan.advantages = at::empty({plan.batch, seq_len},
                              step_rewards.options().dtype(accumulate_type(step_rewards.scalar_type())));
  return plan;
}

// ---------------------------------------------------------------------------------------------------------------
// grpo_loss_forward / grpo_loss_backward
// ---------------------------------------------------------------------------------------------------------------

#define GRPO_LOSS_FORWARD_PARAMS                                                                                   \
  const at::Tensor &logps, const at::Tensor &advantages, const at::Tensor &completion_mask,                        \
      const std::optional<at::Tensor>&old_logps, const std::optional<at::Tensor>&ref_logps,                        \
      const std::optional<at::Tensor>&is_weights, const std::optional<at::Tensor>&sample_mask,                     \
      std::optional<double> num_items_in_batch, const std::optional<at::Tensor>&num_items_tensor,                  \
      c10::string_view loss_type, double epsilon_low, double epsilon_high, std::optional<double> delta,           \
      double beta, c10::string_view kl_estimator, std::optional<double> kl_clamp, bool use_bias_correction_kl,     \
      c10::string_view importance_sampling_level, int64_t max_completion_length, double sapo_temperature_pos,      \
      double sapo_temperature_neg, double loss_scale, bool compute_grad
#define GRPO_LOSS_FORWARD_ARGS                                                                                     \
  logps, advantages, completion_mask, old_logps, ref_logps, is_weights, sample_mask, num_items_in_batch,           \
      num_items_tensor, loss_type, epsilon_low, epsilon_high, delta, beta, kl_estimator, kl_clamp,                 \
      use_bias_correction_kl, importance_sampling_level, max_completion_length, sapo_temperature_pos,              \
      sapo_temperature_neg, loss_scale, compute_grad

// Every loss-op argument after `logps`, shared by the loss op and the logits ops.
#define GRPO_LOSS_INPUTS_PARAMS                                                                                    \
  const at::Tensor &advantages, const at::Tensor &completion_mask, const std::optional<at::Tensor>&old_logps,    \
      const std::optional<at::Tensor>&ref_logps, const std::optional<at::Tensor>&is_weights,                       \
      const std::optional<at::Tensor>&sample_mask, std::optional<double> num_items_in_batch,                      \
      const std::optional<at::Tensor>&num_items_tensor, c10::string_view loss_type, double epsilon_low,           \
      double epsilon_high, std::optional<double> delta, double beta, c10::string_view kl_estimator,               \
      std::optional<double> kl_clamp, bool use_bias_correction_kl, c10::string_view importance_sampling_level,    \
      int64_t max_completion_length, double sapo_temperature_pos, double sapo_temperature_neg, double loss_scale, \
      bool compute_grad
#define GRPO_LOSS_FORWARD_ARGS_AFTER_LOGPS                                                                         \
  advantages, completion_mask, old_logps, ref_logps, is_weights, sample_mask, num_items_in_batch,                  \
      num_items_tensor, loss_type, epsilon_low, epsilon_high, delta, beta, kl_estimator, kl_clamp,                 \
      use_bias_correction_kl, importance_sampling_level, max_completion_length, sapo_temperature_pos,              \
      sapo_temperature_neg, loss_scale, compute_grad

using LossForwardResult = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

struct LossForwardPlan {
  LossParams params;
  LossInputs inputs;
  int64_t max_completion_length = 1;
  bool has_num_items = false;
  double num_items = 0.0;           // used when has_num_items and num_items_device is empty
  at::Tensor num_items_device;      // 1-element accumulate-type tensor on the op's device, or undefined
  double loss_scale = 1.0;
  at::Tensor loss, metrics, grad_raw, grad_scale;
  LossForwardResult result() const { return {loss, metrics, grad_raw, grad_scale}; }
};

// The loss inputs of a [batch, seq_len] problem, checked and viewed; `logps` may be null (the logits ops compute
// them), `like` gives the device (named `like_name` in errors) and `acc` the statistics dtype.
inline LossForwardPlan plan_loss_inputs(int64_t batch, int64_t seq_len, const at::Tensor* logps, const at::Tensor& like,
                                        at::ScalarType acc, GRPO_LOSS_INPUTS_PARAMS, const char* like_name = "logps") {
  LossForwardPlan plan;
  LossInputs& in = plan.inputs;
  in.batch = batch;
  in.seq_len = seq_len;
  if (logps != nullptr) in.logps = matrix_view(*logps, batch, seq_len, "logps", false);

  check_float(advantages, "advantages");
  check_same_device(advantages, like, "advantages", like_name);
  in.advantages = matrix_view(advantages, batch, seq_len, "advantages", true);
  const bool per_row_advantages = in.advantages.col_stride == 0;

  TORCH_CHECK(completion_mask.scalar_type() == at::kBool || is_float_type(completion_mask.scalar_type()) ||
                  at::isIntegralType(completion_mask.scalar_type(), false),
              "completion_mask must be bool, integer or floating-point, got ", completion_mask.scalar_type());
  check_same_device(completion_mask, like, "completion_mask", like_name);
  in.mask = matrix_view(completion_mask, batch, seq_len, "completion_mask", false);

  if (old_logps.has_value()) {
    check_float(*old_logps, "old_logps");
    check_same_device(*old_logps, like, "old_logps", like_name);
    in.old_logps = matrix_view(*old_logps, batch, seq_len, "old_logps", false);
  }
  if (ref_logps.has_value()) {
    check_float(*ref_logps, "ref_logps");
    check_same_device(*ref_logps, like, "ref_logps", like_name);
    in.ref_logps = matrix_view(*ref_logps, batch, seq_len, "ref_logps", false);
  }
  if (is_weights.has_value()) {
    check_float(*is_weights, "is_weights");
    check_same_device(*is_weights, like, "is_weights", like_name);
    in.is_weights = matrix_view(*is_weights, batch, seq_len, "is_weights", true);
  }
  if (sample_mask.has_value()) {
    const at::Tensor& s = *sample_mask;
    check_same_device(s, like, "sample_mask", like_name);
    TORCH_CHECK(s.dim() == 1 && s.size(0) == batch, "sample_mask must have shape [", batch, "], got ", s.sizes());
    in.sample_mask = matrix_view(s, batch, 1, "sample_mask", true);
  }

  LossParams& p = plan.params;
  p.loss_type = parse_loss_type(loss_type);
  p.kl_estimator = parse_kl_estimator(kl_estimator);
  p.sequence_level = parse_sequence_level(importance_sampling_level);
  p.row_share_metrics = p.sequence_level && per_row_advantages;
  TORCH_CHECK(epsilon_low > 0, "epsilon must be > 0, got ", epsilon_low);
  TORCH_CHECK(epsilon_high > 0, "epsilon_high must be > 0, got ", epsilon_high);
  p.epsilon_low = epsilon_low;
  p.epsilon_high = epsilon_high;
  if (delta.has_value()) {
    TORCH_CHECK(*delta > 1.0, "delta must be > 1 (it caps the ratio above 1 + epsilon_high), got ", *delta);
    p.has_delta = true;
    p.delta = *delta;
  }
  TORCH_CHECK(beta >= 0, "beta must be >= 0, got ", beta);
  p.beta = beta;
  TORCH_CHECK(beta == 0.0 || ref_logps.has_value(), "ref_logps is required when beta != 0 (beta=", beta, ")");
  if (kl_clamp.has_value()) {
    TORCH_CHECK(*kl_clamp > 0, "kl_clamp must be > 0, got ", *kl_clamp);
    p.has_kl_clamp = true;
    p.kl_clamp = *kl_clamp;
  }
  p.bias_correction = use_bias_correction_kl;
  p.has_old = old_logps.has_value();
  TORCH_CHECK(sapo_temperature_pos > 0, "sapo_temperature_pos must be > 0, got ", sapo_temperature_pos);
  TORCH_CHECK(sapo_temperature_neg > 0, "sapo_temperature_neg must be > 0, got ", sapo_temperature_neg);
  p.sapo_tau_pos = sapo_temperature_pos;
  p.sapo_tau_neg = sapo_temperature_neg;
  p.compute_grad = compute_grad;

  TORCH_CHECK(max_completion_length >= 1, "max_completion_length must be >= 1, got ", max_completion_length);
  plan.max_completion_length = max_completion_length;
  plan.loss_scale = loss_scale;

  const auto opts = like.options().dtype(acc);
  TORCH_CHECK(!(num_items_in_batch.has_value() && num_items_tensor.has_value()),
              "pass num_items_in_batch as a number or as a tensor, not both");
  if (num_items_in_batch.has_value()) {
    TORCH_CHECK(*num_items_in_batch > 0, "num_items_in_batch must be > 0, got ", *num_items_in_batch);
    plan.has_num_items = true;
    plan.num_items = *num_items_in_batch;
  } else if (num_items_tensor.has_value()) {
    const at::Tensor& n = *num_items_tensor;
    TORCH_CHECK(n.numel() == 1, "num_items_in_batch must be a number or a one-element tensor, got shape ",
                n.sizes());
    plan.has_num_items = true;
    if (n.device().is_cpu()) {
      plan.num_items = n.item<double>();  // a host tensor: reading it needs no device sync
      TORCH_CHECK(plan.num_items > 0, "num_items_in_batch must be > 0, got ", plan.num_items);
    } else {
      check_same_device(n, like, "num_items_in_batch", like_name);
      plan.num_items_device = n.reshape({1}).to(acc);
    }
  }

  plan.loss = at::empty({}, opts);
  plan.metrics = at::empty({kNumMetrics}, opts);
  plan.grad_raw = compute_grad ? at::empty({batch, seq_len}, opts) : at::empty({0}, opts);
  plan.grad_scale = at::empty({}, opts);
  return plan;
}

inline LossForwardPlan plan_loss_forward(GRPO_LOSS_FORWARD_PARAMS) {
  check_float(logps, "logps");
  TORCH_CHECK(logps.dim() == 2, "logps must have shape [B, T], got ", logps.sizes());
  TORCH_CHECK(logps.size(0) >= 1, "logps must have at least one row (B >= 1), got shape ", logps.sizes());
  return plan_loss_inputs(logps.size(0), logps.size(1), &logps, logps, accumulate_type(logps.scalar_type()),
                          GRPO_LOSS_FORWARD_ARGS_AFTER_LOGPS);
}

inline void check_loss_backward(const at::Tensor& grad_loss, const at::Tensor& grad_raw, const at::Tensor& grad_scale,
                                at::ScalarType out_dtype) {
  TORCH_CHECK(grad_loss.numel() == 1, "grad_loss must have one element, got shape ", grad_loss.sizes());
  TORCH_CHECK(grad_scale.numel() == 1, "grad_scale must have one element, got shape ", grad_scale.sizes());
  TORCH_CHECK(grad_raw.dim() == 2, "grad_raw must have shape [B, T] (was the forward run with compute_grad=True?)",
              ", got ", grad_raw.sizes());
  TORCH_CHECK(grad_raw.is_contiguous(), "grad_raw must be contiguous");
  TORCH_CHECK(grad_raw.scalar_type() == grad_scale.scalar_type(), "grad_raw and grad_scale must share a dtype");
  check_same_device(grad_loss, grad_raw, "grad_loss", "grad_raw");
  check_same_device(grad_scale, grad_raw, "grad_scale", "grad_raw");
  TORCH_CHECK(is_float_type(out_dtype), "out_dtype must be a floating-point dtype, got ", out_dtype);
}

// ---------------------------------------------------------------------------------------------------------------
// selective_log_softmax (spec section 2)
// ---------------------------------------------------------------------------------------------------------------

// Per-row statistics the forward keeps for the backward: logsumexp(z) and E_p[z].
constexpr int kSoftmaxStats = 2;

using SelectiveLogSoftmaxResult = std::tuple<at::Tensor, at::Tensor, at::Tensor>;

struct SelectiveLogSoftmaxPlan {
  StridedMatrix logits;  // [N, V]
  StridedMatrix ids;     // [N, 1]
  int64_t rows = 0, vocab = 0;
  double temperature = 1.0;
  bool return_entropy = false;
  at::Tensor logps, entropy, row_stats;
};

inline void check_logits_and_ids(const at::Tensor& logits, const at::Tensor& ids, double temperature) {
  check_float(logits, "logits");
  TORCH_CHECK(logits.dim() == 2, "logits must have shape [N, V], got ", logits.sizes());
  TORCH_CHECK(logits.size(1) >= 1, "logits must have a vocabulary of at least one entry (V >= 1)");
  TORCH_CHECK(ids.scalar_type() == at::kLong || ids.scalar_type() == at::kInt,
              "ids must be an int64 (or int32) tensor, got ", ids.scalar_type());
  TORCH_CHECK(ids.dim() == 1 && ids.size(0) == logits.size(0), "ids must have shape [", logits.size(0), "], got ",
              ids.sizes());
  check_same_device(ids, logits, "ids", "logits");
  TORCH_CHECK(temperature > 0, "temperature must be > 0, got ", temperature);
}

inline SelectiveLogSoftmaxPlan plan_selective_log_softmax(const at::Tensor& logits, const at::Tensor& ids,
                                                          double temperature, bool return_entropy) {
  check_logits_and_ids(logits, ids, temperature);
  SelectiveLogSoftmaxPlan plan;
  plan.rows = logits.size(0);
  plan.vocab = logits.size(1);
  plan.temperature = temperature;
  plan.return_entropy = return_entropy;
  plan.logits = matrix_view(logits, plan.rows, plan.vocab, "logits", false);
  plan.ids = matrix_view(ids, plan.rows, 1, "ids", true);
  const auto opts = logits.options().dtype(accumulate_type(logits.scalar_type()));
  plan.logps = at::empty({plan.rows}, opts);
  plan.entropy = return_entropy ? at::empty({plan.rows}, opts) : at::empty({0}, opts);
  plan.row_stats = at::empty({plan.rows, kSoftmaxStats}, opts);
  return plan;
}

inline void check_selective_log_softmax_backward(const at::Tensor& grad_logps,
                                                 const std::optional<at::Tensor>& grad_entropy,
                                                 const at::Tensor& logits, const at::Tensor& ids,
                                                 const at::Tensor& row_stats, double temperature) {
  check_logits_and_ids(logits, ids, temperature);
  const int64_t rows = logits.size(0);
  TORCH_CHECK(grad_logps.dim() == 1 && grad_logps.size(0) == rows, "grad_logps must have shape [", rows, "], got ",
              grad_logps.sizes());
  check_same_device(grad_logps, logits, "grad_logps", "logits");
  if (grad_entropy.has_value()) {
    TORCH_CHECK(grad_entropy->dim() == 1 && grad_entropy->size(0) == rows, "grad_entropy must have shape [", rows,
                "], got ", grad_entropy->sizes());
    check_same_device(*grad_entropy, logits, "grad_entropy", "logits");
  }
  TORCH_CHECK(row_stats.dim() == 2 && row_stats.size(0) == rows && row_stats.size(1) == kSoftmaxStats &&
                  row_stats.is_contiguous(),
              "row_stats must be the contiguous [N, 2] statistics of the forward, got ", row_stats.sizes());
  TORCH_CHECK(row_stats.scalar_type() == accumulate_type(logits.scalar_type()),
              "row_stats must have the forward's statistics dtype");
  check_same_device(row_stats, logits, "row_stats", "logits");
}


// ---------------------------------------------------------------------------------------------------------------
// grpo_logits_pass / grpo_logits_pass_ (the fused loss from logits, spec sections 2-7)
// ---------------------------------------------------------------------------------------------------------------

#define GRPO_LOGITS_PASS_PARAMS                                                                                    \
  const at::Tensor &logits, const at::Tensor &ids, int64_t row_offset, const at::Tensor &advantages,               \
      const at::Tensor &completion_mask, const std::optional<at::Tensor>&old_logps,                                \
      const std::optional<at::Tensor>&ref_logps, const std::optional<at::Tensor>&is_weights,                       \
      const std::optional<at::Tensor>&sample_mask, std::optional<double> num_items_in_batch,                      \
      const std::optional<at::Tensor>&num_items_tensor, const std::optional<at::Tensor>&token_grad,               \
      c10::string_view loss_type, double epsilon_low, double epsilon_high, std::optional<double> delta,           \
      double beta, c10::string_view kl_estimator, std::optional<double> kl_clamp, bool use_bias_correction_kl,     \
      int64_t max_completion_length, double sapo_temperature_pos, double sapo_temperature_neg, double loss_scale,  \
      double temperature, bool compute_grad
#define GRPO_LOGITS_PASS_ARGS                                                                                      \
  logits, ids, row_offset, advantages, completion_mask, old_logps, ref_logps, is_weights, sample_mask,             \
      num_items_in_batch, num_items_tensor, token_grad, loss_type, epsilon_low, epsilon_high, delta, beta,         \
      kl_estimator, kl_clamp, use_bias_correction_kl, max_completion_length, sapo_temperature_pos,                 \
      sapo_temperature_neg, loss_scale, temperature, compute_grad

using LogitsPassResult = std::tuple<at::Tensor, at::Tensor, at::Tensor>;

struct LogitsPassPlan {
  LossForwardPlan loss;  // the [B, T] loss inputs and options (its logps view is unused)
  LogitsRows logits;
  StridedMatrix ids;         // [R, 1]
  StridedMatrix token_grad;  // [R, 1] d loss / d logp per row, or absent (then computed from the loss inputs)
  int64_t row_offset = 0;    // row r of the logits is token row_offset + r of the flattened [B, T] problem
  double temperature = 1.0;
  bool compute_grad = true;
  at::Tensor logps, entropy, grad_logits;
  void* grad_data = nullptr;  // grad_logits' storage, or the logits' own for the in-place op
  DType grad_dtype = DType::kFloat32;
  LogitsPassResult result() const { return {logps, entropy, grad_logits}; }
};

// Rows of [R, V] or [B', T', V] logits whose last dimension is contiguous (rows may be strided).
inline LogitsRows logits_rows(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 || logits.dim() == 3, "logits must have shape [N, V] or [B, T, V], got ",
              logits.sizes());
  TORCH_CHECK(logits.size(-1) >= 1, "logits must have a vocabulary of at least one entry (V >= 1)");
  TORCH_CHECK(logits.stride(-1) == 1 || logits.size(-1) == 1,
              "logits must be contiguous in the vocabulary dimension (stride(-1) == 1), got strides ",
              logits.strides(), "; pass logits.contiguous()");
  LogitsRows rows;
  rows.data = logits.data_ptr();
  rows.dtype = dtype_tag(logits.scalar_type(), "logits");
  rows.vocab = logits.size(-1);
  if (logits.dim() == 2) {
    rows.rows = logits.size(0);
    rows.inner = rows.rows > 0 ? rows.rows : 1;
    rows.stride_outer = 0;
    rows.stride_inner = logits.stride(0);
  } else {
    rows.rows = logits.size(0) * logits.size(1);
    rows.inner = logits.size(1) > 0 ? logits.size(1) : 1;
    rows.stride_outer = logits.stride(0);
    rows.stride_inner = logits.stride(1);
  }
  return rows;
}

inline LogitsPassPlan plan_logits_pass(GRPO_LOGITS_PASS_PARAMS, bool inplace) {
  check_float(logits, "logits");
  TORCH_CHECK(temperature > 0, "temperature must be > 0, got ", temperature);
  TORCH_CHECK(completion_mask.dim() == 2, "completion_mask must have shape [B, T], got ", completion_mask.sizes());
  const int64_t batch = completion_mask.size(0), seq_len = completion_mask.size(1);
  TORCH_CHECK(batch >= 1, "completion_mask must have at least one row (B >= 1), got shape ", completion_mask.sizes());
  LogitsPassPlan plan;
  plan.logits = logits_rows(logits);
  const int64_t rows = plan.logits.rows;
  TORCH_CHECK(row_offset >= 0 && row_offset + rows <= batch * seq_len, "row_offset=", row_offset, " and ", rows,
              " logits rows exceed the B*T=", batch * seq_len, " tokens of completion_mask");
  TORCH_CHECK(ids.scalar_type() == at::kLong || ids.scalar_type() == at::kInt,
              "ids must be an int64 (or int32) tensor, got ", ids.scalar_type());
  TORCH_CHECK(ids.dim() == 1 && ids.size(0) == rows, "ids must have shape [", rows, "] (one per logits row), got ",
              ids.sizes());
  check_same_device(ids, logits, "ids", "logits");
  plan.ids = matrix_view(ids, rows, 1, "ids", true);
  const at::ScalarType acc = accumulate_type(logits.scalar_type());
  plan.loss = plan_loss_inputs(batch, seq_len, nullptr, logits, acc, advantages, completion_mask, old_logps,
                               ref_logps, is_weights, sample_mask, num_items_in_batch, num_items_tensor, loss_type,
                               epsilon_low, epsilon_high, delta, beta, kl_estimator, kl_clamp,
                               use_bias_correction_kl, "token", max_completion_length, sapo_temperature_pos,
                               sapo_temperature_neg, loss_scale, /*compute_grad=*/false, "logits");
  if (token_grad.has_value()) {
    const at::Tensor& g = *token_grad;
    check_float(g, "token_grad");
    check_same_device(g, logits, "token_grad", "logits");
    TORCH_CHECK(g.dim() == 1 && g.size(0) == rows, "token_grad must have shape [", rows, "], got ", g.sizes());
    plan.token_grad = matrix_view(g, rows, 1, "token_grad", true);
  }
  plan.row_offset = row_offset;
  plan.temperature = temperature;
  plan.compute_grad = compute_grad;
  const auto opts = logits.options().dtype(acc);
  plan.logps = at::empty({rows}, opts);
  plan.entropy = at::empty({rows}, opts);
  plan.grad_dtype = plan.logits.dtype;
  if (inplace) {
    plan.grad_data = logits.data_ptr();
    plan.grad_logits = at::empty({0}, logits.options());
  } else if (compute_grad) {
    plan.grad_logits = at::empty({rows, plan.logits.vocab}, logits.options().memory_format(at::MemoryFormat::Contiguous));
    plan.grad_data = plan.grad_logits.data_ptr();
  } else {
    plan.grad_logits = at::empty({0}, logits.options());
  }
  return plan;
}

// The in-place op writes each row's gradient over that row of the logits: the rows must not overlap.
inline void check_inplace_logits(const at::Tensor& logits) {
  TORCH_CHECK(logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kBFloat16 ||
                  logits.scalar_type() == at::kHalf || logits.scalar_type() == at::kDouble,
              "inplace logits must be float32, bfloat16, float16 or float64, got ", logits.scalar_type());
  TORCH_CHECK(!logits.is_inference(), "inplace_grad cannot write into an inference tensor");
  const int64_t vocab = logits.size(-1);
  bool rows_disjoint = true;
  for (int64_t d = 0; d + 1 < logits.dim(); ++d) {
    if (logits.size(d) > 1 && logits.stride(d) < vocab) rows_disjoint = false;
  }
  TORCH_CHECK(rows_disjoint, "inplace_grad needs logits whose rows do not overlap in memory, got strides ",
              logits.strides());
}

}  // namespace grpo_ext
