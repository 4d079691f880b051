// The strings each string option accepts and the codes they parse to, written once (framework-free) for the
// bindings' planning (plan/*.h, which rejects anything else with a TORCH_CHECK naming the option) and the CUDA
// emulation harness (tests/cuda_emu), so both read the same names.
#pragma once

#include "common.h"

namespace grpo_ext {

// One accepted string of a string option and the value it parses to.
template <typename E>
struct Choice {
  const char* name;
  E value;
};

inline constexpr Choice<LossType> kLossTypeChoices[] = {{"grpo", LossType::kGRPO},      {"bnpo", LossType::kBNPO},
                                                        {"dr_grpo", LossType::kDrGRPO}, {"dapo", LossType::kDAPO},
                                                        {"luspo", LossType::kLUSPO},    {"cispo", LossType::kCISPO},
                                                        {"sapo", LossType::kSAPO},      {"vespo", LossType::kVESPO}};
inline constexpr Choice<KLEstimator> kKLEstimatorChoices[] = {{"k1", KLEstimator::kK1},
                                                              {"k2", KLEstimator::kK2},
                                                              {"k3", KLEstimator::kK3},
                                                              {"abs", KLEstimator::kAbs},
                                                              {"k1+", KLEstimator::kK1Plus},
                                                              {"k3+", KLEstimator::kK3Plus},
                                                              {"low_var_kl", KLEstimator::kLowVarKL}};
// importance_sampling_level: whether the ratio is per sequence (GSPO).
inline constexpr Choice<bool> kSequenceLevelChoices[] = {{"token", false}, {"sequence", true}};
inline constexpr Choice<ScaleRewards> kScaleRewardsChoices[] = {
    {"group", ScaleRewards::kGroup}, {"batch", ScaleRewards::kBatch}, {"none", ScaleRewards::kNone}};
inline constexpr Choice<Baseline> kBaselineChoices[] = {{"mean", Baseline::kMean},
                                                        {"leave_one_out", Baseline::kLeaveOneOut}};
inline constexpr Choice<Aggregation> kAggregationChoices[] = {{"sum_then_normalize", Aggregation::kSumThenNormalize},
                                                              {"normalize_then_sum", Aggregation::kNormalizeThenSum}};
// singleton_groups: whether groups of one row follow verl's convention (mean 0, std 1).
inline constexpr Choice<bool> kSingletonGroupsChoices[] = {{"zero", false}, {"verl", true}};

}  // namespace grpo_ext
