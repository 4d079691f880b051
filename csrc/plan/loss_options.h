// The loss options of every loss op (grpo_loss and the logits pass) and their host planning: the ONE definition of
// their names, schema types and C++ types (GRPO_LOSS_OPTIONS), from which the schemas in ops.cpp, the bindings'
// parameter lists and LossOptionArgs are generated; parsing and checks of the values; the shared [B, T] loss plan.
// Adding an option: one line in GRPO_LOSS_OPTIONS here and one field in python/grpo_ext/ops/options.py
// (docs/architecture.md). The math of each option: docs/math.md sections 3-7.
#pragma once

#include <cmath>
#include <optional>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <utility>

#include "../grpo_loss_params.h"
#include "checks.h"

// X(schema type, C++ parameter type, name), in the order the ops take them after their tensors and masks. The
// Python LossOptions (python/grpo_ext/ops/options.py) has the same names in the same order; num_items_in_batch and
// loss_scale are a number there or a tensor, each split here into a float and a one-element tensor (a device tensor
// is read by the kernels, never by the host: reading it here would sync the host with the device).
#define GRPO_LOSS_OPTIONS(X)                                    \
  X("Tensor?", const std::optional<Tensor>&, old_logps)         \
  X("Tensor?", const std::optional<Tensor>&, ref_logps)         \
  X("Tensor?", const std::optional<Tensor>&, is_weights)        \
  X("Tensor?", const std::optional<Tensor>&, sample_mask)       \
  X("str", std::string_view, loss_type)                         \
  X("float", double, epsilon)                                   \
  X("float", double, epsilon_high)                              \
  X("float?", std::optional<double>, delta)                     \
  X("float", double, beta)                                      \
  X("str", std::string_view, kl_estimator)                      \
  X("float?", std::optional<double>, kl_clamp)                  \
  X("bool", bool, use_bias_correction_kl)                       \
  X("str", std::string_view, importance_sampling_level)         \
  X("int", int64_t, max_completion_length)                      \
  X("float?", std::optional<double>, num_items_in_batch)        \
  X("Tensor?", const std::optional<Tensor>&, num_items_tensor)  \
  X("float", double, sapo_temperature_pos)                      \
  X("float", double, sapo_temperature_neg)                      \
  X("float", double, vespo_k_pos)                               \
  X("float", double, vespo_lambda_pos)                          \
  X("float", double, vespo_k_neg)                               \
  X("float", double, vespo_lambda_neg)                          \
  X("float", double, loss_scale)                                \
  X("Tensor?", const std::optional<Tensor>&, loss_scale_tensor) \
  X("bool", bool, skip_empty_rows)                              \
  X("Tensor?", const std::optional<Tensor>&, policy_weights)

#define GRPO_OPTION_SCHEMA(schema_type, cpp_type, name) schema_type " " #name ", "
#define GRPO_OPTION_PARAM(schema_type, cpp_type, name) cpp_type name,
#define GRPO_OPTION_VALUE(schema_type, cpp_type, name) name,
#define GRPO_OPTION_FIELD(schema_type, cpp_type, name) std::remove_cvref_t<cpp_type> name;

// "Tensor? old_logps, ..., float loss_scale, " for a schema; the parameters of a binding (each followed by a
// comma); and the same parameters gathered into one LossOptionArgs value.
#define GRPO_LOSS_OPTIONS_SCHEMA GRPO_LOSS_OPTIONS(GRPO_OPTION_SCHEMA)
#define GRPO_LOSS_OPTION_PARAMS GRPO_LOSS_OPTIONS(GRPO_OPTION_PARAM)
#define GRPO_LOSS_OPTION_VALUES          \
  ::grpo_ext::LossOptionArgs {           \
    GRPO_LOSS_OPTIONS(GRPO_OPTION_VALUE) \
  }

namespace grpo_ext {

// The options as the op received them (strings not parsed yet); valid for the duration of the op call.
struct LossOptionArgs {
  GRPO_LOSS_OPTIONS(GRPO_OPTION_FIELD)
};

inline LossType parse_loss_type(std::string_view s) {
  return parse_choice("loss_type", s, kLossTypeChoices);
}

inline KLEstimator parse_kl_estimator(std::string_view s) {
  return parse_choice("kl_estimator", s, kKLEstimatorChoices);
}

inline bool parse_sequence_level(std::string_view s) {
  return parse_choice("importance_sampling_level", s, kSequenceLevelChoices);
}

using LossForwardResult = std::tuple<Tensor, Tensor, Tensor, Tensor>;

struct LossForwardPlan {
  LossParams params;
  LossInputs inputs;
  int64_t max_completion_length = 1;
  bool has_num_items = false;
  double num_items = 0.0;    // used when has_num_items and num_items_device is empty
  Tensor num_items_device;   // 1-element accumulate-type tensor on the op's device, or undefined
  double loss_scale = 1.0;   // times loss_scale_device[0] when that is defined (then this is 1)
  Tensor loss_scale_device;  // 1-element accumulate-type tensor on the op's device, or undefined
  Tensor loss, metrics, grad_raw, grad_scale;
  // The two numbers as a kernel takes them (T: the accumulate type of the *_device tensors).
  template <typename T>
  DeviceNumber<T> num_items_arg() const {
    return {num_items, num_items_device.defined() ? num_items_device.const_data_ptr<T>() : nullptr};
  }
  template <typename T>
  DeviceNumber<T> loss_scale_arg() const {
    return {loss_scale, loss_scale_device.defined() ? loss_scale_device.const_data_ptr<T>() : nullptr};
  }
  LossForwardResult result() const { return {loss, metrics, grad_raw, grad_scale}; }
};

// A NaN or +-inf mask value is a caller's mistake (docs/math.md, "Masks"), refused as the Python functions refuse it;
// only a host tensor is read (reading a CUDA one would sync the host: there the loss is NaN instead).
inline void check_mask_finite(const Tensor& mask, const StridedMatrix& view, int64_t rows, int64_t cols,
                              const char* name) {
  if (!mask.is_cpu() || !is_float_type(mask.scalar_type())) return;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      const double v = view.load<double>(r, c);
      GRPO_CHECK(std::isfinite(v), name, " holds ", v, "; a mask's values must be finite (0 or 1, or weights)");
    }
  }
}

// A number given as a one-element tensor: its value when the tensor is on the host (reading it needs no device
// sync), else nullopt and `*device_copy` set to it on `like`'s device in `acc`, for the kernels to read.
inline std::optional<double> host_value_or_device_copy(const Tensor& t, const char* name, const Tensor& like,
                                                       const char* like_name, ScalarType acc, Tensor* device_copy) {
  GRPO_CHECK(t.numel() == 1, name, " must be a number or a one-element tensor, got shape ", shape(t));
  if (t.is_cpu()) return StridedMatrix{t.data_ptr(), dtype_tag(t.scalar_type(), name)}.load<double>(0, 0);
  check_same_device(t, like, name, like_name);
  *device_copy = torch::stable::to(torch::stable::reshape(t, {1}), acc);
  return std::nullopt;
}

// The loss inputs of a [batch, seq_len] problem, checked and viewed, without outputs (allocate_loss_outputs);
// `logps` may be null (the logits op computes them), `like` gives the device (named `like_name` in errors) and `acc`
// the statistics dtype.
inline LossForwardPlan plan_loss_inputs(int64_t batch, int64_t seq_len, const Tensor* logps, const Tensor& like,
                                        ScalarType acc, const Tensor& advantages, const Tensor& completion_mask,
                                        const LossOptionArgs& o, bool compute_grad, const char* like_name = "logps") {
  LossForwardPlan plan;
  LossInputs& in = plan.inputs;
  in.batch = batch;
  in.seq_len = seq_len;
  if (logps != nullptr) in.logps = matrix_view(*logps, batch, seq_len, "logps", false);

  check_float(advantages, "advantages");
  check_same_device(advantages, like, "advantages", like_name);
  in.advantages = matrix_view(advantages, batch, seq_len, "advantages", true);
  const bool per_row_advantages = in.advantages.col_stride == 0;

  GRPO_CHECK(completion_mask.scalar_type() == ScalarType::Bool || is_float_type(completion_mask.scalar_type()) ||
                 is_integral(completion_mask.scalar_type()),
             "completion_mask must be bool, integer or floating-point, got ", completion_mask.scalar_type());
  check_same_device(completion_mask, like, "completion_mask", like_name);
  in.mask = matrix_view(completion_mask, batch, seq_len, "completion_mask", false);
  check_mask_finite(completion_mask, in.mask, batch, seq_len, "completion_mask");

  if (o.old_logps.has_value()) {
    check_float(*o.old_logps, "old_logps");
    check_same_device(*o.old_logps, like, "old_logps", like_name);
    in.old_logps = matrix_view(*o.old_logps, batch, seq_len, "old_logps", false);
  }
  if (o.ref_logps.has_value()) {
    check_float(*o.ref_logps, "ref_logps");
    check_same_device(*o.ref_logps, like, "ref_logps", like_name);
    in.ref_logps = matrix_view(*o.ref_logps, batch, seq_len, "ref_logps", false);
  }
  if (o.is_weights.has_value()) {
    check_float(*o.is_weights, "is_weights");
    check_same_device(*o.is_weights, like, "is_weights", like_name);
    in.is_weights = matrix_view(*o.is_weights, batch, seq_len, "is_weights", true);
  }
  if (o.policy_weights.has_value()) {
    check_float(*o.policy_weights, "policy_weights");
    check_same_device(*o.policy_weights, like, "policy_weights", like_name);
    in.policy_weights = matrix_view(*o.policy_weights, batch, seq_len, "policy_weights", true);
  }
  if (o.sample_mask.has_value()) {
    const Tensor& s = *o.sample_mask;
    check_same_device(s, like, "sample_mask", like_name);
    GRPO_CHECK(s.dim() == 1 && s.size(0) == batch, "sample_mask must have shape [", batch, "], got ", shape(s));
    in.sample_mask = matrix_view(s, batch, 1, "sample_mask", true);
    check_mask_finite(s, in.sample_mask, batch, 1, "sample_mask");
  }

  LossParams& p = plan.params;
  p.loss_type = parse_loss_type(o.loss_type);
  p.kl_estimator = parse_kl_estimator(o.kl_estimator);
  p.sequence_level = parse_sequence_level(o.importance_sampling_level);
  p.row_share_metrics = p.sequence_level && per_row_advantages;
  // A zero lower clip range is a legitimate setting (Liger's and open-instruct's CISPO tests use it).
  GRPO_CHECK(o.epsilon >= 0, "epsilon must be >= 0, got ", o.epsilon);
  GRPO_CHECK(o.epsilon_high >= 0, "epsilon_high must be >= 0, got ", o.epsilon_high);
  p.epsilon_low = o.epsilon;
  p.epsilon_high = o.epsilon_high;
  if (o.delta.has_value()) {
    GRPO_CHECK(*o.delta > 1.0, "delta must be > 1 (it caps the ratio above 1 + epsilon_high), got ", *o.delta);
    p.has_delta = true;
    p.delta = *o.delta;
  }
  GRPO_CHECK(o.beta >= 0 && std::isfinite(o.beta), "beta must be a finite number >= 0, got ", o.beta);
  p.beta = o.beta;
  GRPO_CHECK(o.beta == 0.0 || o.ref_logps.has_value(), "ref_logps is required when beta != 0 (beta=", o.beta, ")");
  if (o.kl_clamp.has_value()) {
    GRPO_CHECK(*o.kl_clamp > 0, "kl_clamp must be > 0, got ", *o.kl_clamp);
    p.has_kl_clamp = true;
    p.kl_clamp = *o.kl_clamp;
  }
  p.bias_correction = o.use_bias_correction_kl;
  p.has_old = o.old_logps.has_value();
  GRPO_CHECK(std::isfinite(o.sapo_temperature_pos) && o.sapo_temperature_pos > 0,
             "sapo_temperature_pos must be a finite number > 0, got ", o.sapo_temperature_pos);
  GRPO_CHECK(std::isfinite(o.sapo_temperature_neg) && o.sapo_temperature_neg > 0,
             "sapo_temperature_neg must be a finite number > 0, got ", o.sapo_temperature_neg);
  p.sapo_tau_pos = o.sapo_temperature_pos;
  p.sapo_tau_neg = o.sapo_temperature_neg;
  for (const auto& [value, name] :
       {std::pair{o.vespo_k_pos, "vespo_k_pos"}, std::pair{o.vespo_lambda_pos, "vespo_lambda_pos"},
        std::pair{o.vespo_k_neg, "vespo_k_neg"}, std::pair{o.vespo_lambda_neg, "vespo_lambda_neg"}}) {
    GRPO_CHECK(std::isfinite(value), name, " must be a finite number, got ", value);
  }
  p.vespo_k_pos = o.vespo_k_pos;
  p.vespo_lambda_pos = o.vespo_lambda_pos;
  p.vespo_k_neg = o.vespo_k_neg;
  p.vespo_lambda_neg = o.vespo_lambda_neg;
  p.per_row_advantages = per_row_advantages;
  p.skip_empty_rows = o.skip_empty_rows;
  p.compute_grad = compute_grad;

  GRPO_CHECK(o.max_completion_length >= 1, "max_completion_length must be >= 1, got ", o.max_completion_length);
  plan.max_completion_length = o.max_completion_length;
  GRPO_CHECK(!(o.loss_scale != 1.0 && o.loss_scale_tensor.has_value()),
             "pass loss_scale as a number or as a tensor, not both");
  GRPO_CHECK(std::isfinite(o.loss_scale), "loss_scale must be a finite number, got ", o.loss_scale);
  plan.loss_scale = o.loss_scale;
  if (o.loss_scale_tensor.has_value()) {
    const auto value =
        host_value_or_device_copy(*o.loss_scale_tensor, "loss_scale", like, like_name, acc, &plan.loss_scale_device);
    if (value.has_value()) {
      GRPO_CHECK(std::isfinite(*value), "loss_scale must be a finite number, got ", *value);
      plan.loss_scale = *value;
    }
  }

  GRPO_CHECK(!(o.num_items_in_batch.has_value() && o.num_items_tensor.has_value()),
             "pass num_items_in_batch as a number or as a tensor, not both");
  if (o.num_items_in_batch.has_value()) {
    GRPO_CHECK(*o.num_items_in_batch > 0, "num_items_in_batch must be > 0, got ", *o.num_items_in_batch);
    plan.has_num_items = true;
    plan.num_items = *o.num_items_in_batch;
  } else if (o.num_items_tensor.has_value()) {
    plan.has_num_items = true;
    const auto value = host_value_or_device_copy(*o.num_items_tensor, "num_items_in_batch", like, like_name, acc,
                                                 &plan.num_items_device);
    if (value.has_value()) {
      GRPO_CHECK(*value > 0, "num_items_in_batch must be > 0, got ", *value);
      plan.num_items = *value;
    }
  }

  return plan;
}

// The forward's outputs of a planned loss, on `like`'s device in `acc` (the d loss / d logp buffer only with a
// gradient; its shape is [0] without one, as the ops' fakes say).
inline void allocate_loss_outputs(LossForwardPlan& plan, const Tensor& like, ScalarType acc) {
  plan.loss = new_empty(like, {}, acc);
  plan.metrics = new_empty(like, {kNumMetrics}, acc);
  plan.grad_raw = plan.params.compute_grad ? new_empty(like, {plan.inputs.batch, plan.inputs.seq_len}, acc)
                                           : new_empty(like, {0}, acc);
  plan.grad_scale = new_empty(like, {}, acc);
}

}  // namespace grpo_ext
