"""grpo_ext.integrations.verl against real verl 0.9.1's own functions: every mapped mode, values and gradients.

verl pins an older transformers than TRL, so it lives in a venv of its own: `make test` builds ``.venv-verl``
(verl installed without its dependencies, plus only what ``verl.trainer.ppo.core_algos`` imports; it sees the main
venv) and runs this file there with GRPO_EXT_REQUIRE_VERL=1, where a missing verl fails instead of skipping.
"""

from __future__ import annotations

import os
import re

import numpy as np
import pytest
import torch

if os.environ.get("GRPO_EXT_REQUIRE_VERL") == "1":
    from verl.trainer.ppo import core_algos
else:
    core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")

import verl
from verl.workers.config import ActorConfig

from grpo_ext.integrations import verl as grpo_verl

B, T = 8, 7
LENGTHS = (7, 1, 3, 0, 7, 5, 2, 4)  # one empty row, one full row, one single-token row
GLOBAL_INFOS = {  # verl's global_batch_info: one process, and a rank of a 2-process step with its global counts
    "local": {},
    "dp2": {"dp_size": 2, "batch_num_tokens": 53, "global_batch_size": 15, "loss_scale_factor": None},
}


def test_verl_version_and_registration_through_the_entry_point():
    assert verl.__version__ == "0.9.1"
    # registered by `import verl` itself (entry point verl.plugins), and the registry returns grpo_ext's functions
    assert core_algos.get_policy_loss_fn("grpo_ext") is grpo_verl.compute_policy_loss
    assert core_algos.get_adv_estimator_fn("grpo_ext_grpo") is grpo_verl.compute_grpo_advantage
    assert core_algos.get_adv_estimator_fn("grpo_ext_rloo") is grpo_verl.compute_rloo_advantage


def make_batch(seed: int, spread: float = 0.6):
    g = torch.Generator().manual_seed(seed)
    mask = torch.arange(T).unsqueeze(0) < torch.tensor(LENGTHS).unsqueeze(1)
    log_prob = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3 - 0.1
    old = log_prob + spread * torch.randn(B, T, generator=g, dtype=torch.float64)
    old[0, :3] = log_prob[0, :3] - torch.tensor([1.5, 1.3, -1.5], dtype=torch.float64)  # ratios 4.5, 3.7, 0.2
    ref = log_prob + 0.4 * torch.randn(B, T, generator=g, dtype=torch.float64)
    ref[1, 0], ref[2, :3] = log_prob[1, 0] + 25, log_prob[2, :3] + torch.tensor([3.0, -25.0, -0.7])  # clamps act
    adv = torch.randn(B, 1, generator=g, dtype=torch.float64) * mask
    adv[0] = -adv[0].abs()  # a negative advantage with ratios above clip_ratio_c: the dual clip acts
    weights = torch.rand(B, T, generator=g, dtype=torch.float64) + 0.5
    return log_prob, old, ref, adv, mask, weights


def actor_config(info: str, **overrides) -> ActorConfig:
    fields = dict(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, clip_ratio=0.2, clip_ratio_low=0.2,
                  clip_ratio_high=0.28, clip_ratio_c=3.0)  # fmt: skip
    fields.update(overrides)
    config = ActorConfig(**fields)
    config.global_batch_info.update(GLOBAL_INFOS[info])
    if info == "dp2" and config.loss_scale_factor is not None:
        config.global_batch_info["loss_scale_factor"] = config.loss_scale_factor
    return config


def run(fn, log_prob, *args, **kwargs):
    leaf = log_prob.detach().clone().requires_grad_(True)
    loss, metrics = fn(args[0], leaf, *args[1:], **kwargs)
    loss.backward()
    return loss.detach(), leaf.grad, metrics


# loss_scale_factor acts in seq-mean-token-sum-norm only
AGG_MODES_AND_SCALES = [(mode, None) for mode in grpo_verl.LOSS_AGG_MODES] + [("seq-mean-token-sum-norm", 5)]


@pytest.mark.parametrize("loss_agg_mode,loss_scale_factor", AGG_MODES_AND_SCALES)
@pytest.mark.parametrize("info", sorted(GLOBAL_INFOS))
@pytest.mark.parametrize("with_is_weights", [False, True])
def test_policy_loss_matches_verl_vanilla(loss_agg_mode, loss_scale_factor, info, with_is_weights):
    log_prob, old, _, adv, mask, weights = make_batch(seed=len(loss_agg_mode) + 3 * with_is_weights)
    config = actor_config(info, loss_scale_factor=loss_scale_factor)
    is_weights = weights if with_is_weights else None
    verl_fn = core_algos.get_policy_loss_fn("vanilla")
    ours_fn = core_algos.get_policy_loss_fn("grpo_ext")
    want, want_grad, want_metrics = run(verl_fn, log_prob, old, adv, mask, loss_agg_mode, config, is_weights)
    got, got_grad, got_metrics = run(ours_fn, log_prob, old, adv, mask, loss_agg_mode, config, is_weights)
    torch.testing.assert_close(got, want, rtol=1e-7, atol=1e-12)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-7, atol=1e-12)
    assert set(got_metrics) == set(want_metrics)
    for name, value in want_metrics.items():
        assert got_metrics[name] == pytest.approx(value, rel=1e-6, abs=1e-9), name  # verl's are float32
    assert want_metrics["actor/pg_clipfrac_lower"] > 0 and want_metrics["actor/pg_clipfrac"] > 0  # both clips act


@pytest.mark.parametrize("loss_agg_mode", ["seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"])
def test_skip_empty_rows_is_verls_seq_mean(loss_agg_mode):
    """verl's agg_loss averages the seq-mean modes over the rows with a token: grpo_loss(skip_empty_rows=True)."""
    import grpo_ext

    log_prob, _, _, adv, mask, _ = make_batch(seed=5)
    mask[6] = False  # two empty rows of eight
    loss_type = {"seq-mean-token-mean": "grpo", "seq-mean-token-sum": "luspo", "seq-mean-token-sum-norm": "dr_grpo"}
    leaf = log_prob.clone().requires_grad_(True)
    per_token = -adv * torch.exp(leaf - leaf.detach())  # the policy term on-policy: value -A, gradient -A
    want = core_algos.agg_loss(per_token, mask, loss_agg_mode)
    want.backward()
    results = {}
    for skip in (True, False):
        ours = log_prob.clone().requires_grad_(True)
        got = grpo_ext.grpo_loss(ours, adv, mask, loss_type=loss_type[loss_agg_mode], skip_empty_rows=skip).loss
        got.backward()
        results[skip] = got.detach(), ours.grad
    # verl divides a row's token sum by n + 1e-8 where grpo_ext divides by n: 1e-8 relative at most
    torch.testing.assert_close(results[True][0], want.detach(), rtol=1e-7, atol=1e-12)
    torch.testing.assert_close(results[True][1], leaf.grad, rtol=1e-7, atol=1e-12)
    assert results[False][0].item() == pytest.approx(want.item() * 6 / 8, rel=1e-7)  # the default counts all B rows


@pytest.mark.parametrize("kl_loss_type", sorted(grpo_verl.KL_LOSS_TYPES))
@pytest.mark.parametrize("loss_agg_mode", grpo_verl.LOSS_AGG_MODES)
def test_policy_plus_kl_loss_matches_verl(kl_loss_type, loss_agg_mode):
    """verl's actor loss, pg_loss + kl_loss_coef * agg_loss(kl_penalty), in one grpo_ext.grpo_loss call."""
    import grpo_ext

    log_prob, old, ref, adv, mask, weights = make_batch(seed=11)
    config = actor_config("local", use_kl_loss=True, kl_loss_coef=0.07, kl_loss_type=kl_loss_type)
    leaf = log_prob.clone().requires_grad_(True)
    pg_loss, _ = core_algos.compute_policy_loss_vanilla(old, leaf, adv, mask, loss_agg_mode, config, weights)
    kl = core_algos.kl_penalty(leaf, ref, kl_loss_type)
    want = pg_loss + config.kl_loss_coef * core_algos.agg_loss(kl, mask, loss_agg_mode, **config.global_batch_info)
    want.backward()
    options = grpo_verl.loss_options(config, loss_agg_mode, mask)
    ours = log_prob.clone().requires_grad_(True)
    got = grpo_ext.grpo_loss(ours, adv, mask, old_logps=old, ref_logps=ref, is_weights=weights, **options).loss
    got.backward()
    torch.testing.assert_close(got.detach(), want.detach(), rtol=1e-7, atol=1e-12)
    torch.testing.assert_close(ours.grad, leaf.grad, rtol=1e-7, atol=1e-12)


def shuffled_uids(seed: int, groups: int, size: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    uids = np.array([f"prompt-{g}" for g in range(groups) for _ in range(size)], dtype=object)
    return uids[rng.permutation(len(uids))]


@pytest.mark.parametrize("estimator,norm_adv_by_std_in_grpo", [("grpo", True), ("grpo", False), ("rloo", None)])
@pytest.mark.parametrize("groups,size", [(4, 4), (3, 5), (6, 1), (2, 2)])
def test_advantages_match_verl_with_uid_groups_in_any_order(estimator, norm_adv_by_std_in_grpo, groups, size):
    g = torch.Generator().manual_seed(groups * 10 + size)
    rows, length = groups * size, 5
    mask = torch.rand(rows, length, generator=g) < 0.8
    rewards = torch.zeros(rows, length)
    rewards[torch.arange(rows), length - 1] = torch.randint(0, 3, (rows,), generator=g).float()  # ties and equal groups
    index = shuffled_uids(groups * 7 + size, groups, size)
    verl_fn = core_algos.get_adv_estimator_fn(estimator)
    ours_fn = core_algos.get_adv_estimator_fn(f"grpo_ext_{estimator}")
    kwargs = {"norm_adv_by_std_in_grpo": norm_adv_by_std_in_grpo} if estimator == "grpo" else {}
    want, want_returns = verl_fn(rewards.clone(), mask, index, **kwargs)
    got, got_returns = ours_fn(rewards.clone(), mask, index, **kwargs)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_returns, want_returns, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("estimator,norm_adv_by_std_in_grpo", [("grpo", True), ("grpo", False), ("rloo", None)])
def test_advantages_match_verl_with_uid_groups_of_different_sizes(estimator, norm_adv_by_std_in_grpo):
    """verl groups rows by uid whatever the group sizes: grpo_ext's group_ids do the same in one launch."""
    rng = np.random.default_rng(3)
    sizes = {"a": 1, "b": 4, "c": 2, "d": 7, "e": 1, "f": 3}
    index = np.array([uid for uid, n in sizes.items() for _ in range(n)], dtype=object)[rng.permutation(18)]
    g = torch.Generator().manual_seed(4)
    mask = torch.rand(18, 4, generator=g) < 0.8
    rewards = torch.zeros(18, 4)
    rewards[:, -1] = torch.randint(0, 3, (18,), generator=g).float()
    kwargs = {"norm_adv_by_std_in_grpo": norm_adv_by_std_in_grpo} if estimator == "grpo" else {}
    want, _ = core_algos.get_adv_estimator_fn(estimator)(rewards.clone(), mask, index, **kwargs)
    got, _ = core_algos.get_adv_estimator_fn(f"grpo_ext_{estimator}")(rewards.clone(), mask, index, **kwargs)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_bad_modes_are_named():
    mask = torch.ones(5, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="loss_agg_mode"):
        grpo_verl.loss_options(actor_config("local"), "token-avg", mask)
    for kl_loss_type in ("full", "abs+"):  # no grpo_ext estimator: |r|'s value with k2's gradient, the exact KL
        config = actor_config("local", use_kl_loss=True, kl_loss_type=kl_loss_type)
        with pytest.raises(ValueError, match=f"kl_loss_type must be one of .* got '{re.escape(kl_loss_type)}'"):
            grpo_verl.loss_options(config, "token-mean", mask)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        grpo_verl.loss_options(actor_config("local", clip_ratio_c=1.2), "token-mean", mask)


@pytest.mark.parametrize("kl_loss_type", ["full", "abs+", "k3+"])
def test_policy_loss_takes_any_kl_loss_type(kl_loss_type):
    """verl adds the KL term itself, so the policy loss neither maps nor checks kl_loss_type (an outside audit,
    2026-11-29: 'abs+' and the other straight-through types were refused)."""
    log_prob, old, _, adv, mask, _ = make_batch(seed=2)
    config = actor_config("local", use_kl_loss=True, kl_loss_type=kl_loss_type)
    want, want_grad, _ = run(core_algos.get_policy_loss_fn("vanilla"), log_prob, old, adv, mask, "token-mean", config)
    got, got_grad, _ = run(core_algos.get_policy_loss_fn("grpo_ext"), log_prob, old, adv, mask, "token-mean", config)
    torch.testing.assert_close(got, want, rtol=1e-7, atol=1e-12)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-7, atol=1e-12)


@pytest.mark.parametrize("loss_agg_mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_several_processes_without_the_global_count_are_refused_as_verl_refuses_them(loss_agg_mode):
    log_prob, old, _, adv, mask, _ = make_batch(seed=4)
    config = actor_config("local")
    config.global_batch_info.update(dp_size=2)
    for name in ("vanilla", "grpo_ext"):
        with pytest.raises(ValueError, match="required when dp_size > 1"):
            run(core_algos.get_policy_loss_fn(name), log_prob, old, adv, mask, loss_agg_mode, config)


def test_nan_at_padding_stays_out_of_the_metrics():
    log_prob, old, _, adv, mask, _ = make_batch(seed=6)
    old[~mask] = float("nan")  # padding holds anything
    config = actor_config("local")
    want, want_grad, want_metrics = run(core_algos.get_policy_loss_fn("vanilla"), log_prob, old, adv, mask,
                                        "token-mean", config)  # fmt: skip
    got, got_grad, got_metrics = run(core_algos.get_policy_loss_fn("grpo_ext"), log_prob, old, adv, mask,
                                     "token-mean", config)  # fmt: skip
    torch.testing.assert_close(got, want, rtol=1e-7, atol=1e-12)
    assert torch.isfinite(got_grad).all() and torch.count_nonzero(got_grad[~mask]) == 0
    torch.testing.assert_close(got_grad[mask], want_grad[mask], rtol=1e-7, atol=1e-12)
    assert got_metrics["actor/ppo_kl"] == pytest.approx(want_metrics["actor/ppo_kl"], rel=1e-6)
    assert all(np.isfinite(value) for value in got_metrics.values())
