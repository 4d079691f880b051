// The loss options and inputs of the loss ops on the emulated device: plan/loss_options.h's plan_loss_inputs without
// torch (the arguments are read in GRPO_LOSS_OPTIONS order).
#pragma once

#include "driver.h"
#include "grpo_loss_math.h"

namespace cuda_emu {

struct LossPlan {
  grpo_ext::LossParams params;
  grpo_ext::LossInputs inputs;
  int64_t max_completion_length = 1;
  bool has_num_items = false;
  double num_items = 0.0;
  std::optional<Tensor> num_items_device;  // in the accumulate type
  double loss_scale = 1.0;
  std::vector<Tensor> keep;  // the input tensors the views point into
};

// Reads the loss options from `a` and views the [batch, seq_len] inputs; `logps` may be absent (the logits pass).
// `force_token_level`: the logits pass plans every loss per token (a sequence-level loss hands it token_grad).
LossPlan plan_loss_inputs(int64_t batch, int64_t seq_len, const std::optional<Tensor>& logps, DType acc,
                          const Tensor& advantages, const Tensor& mask, Args& a, bool compute_grad,
                          bool force_token_level);

}  // namespace cuda_emu
