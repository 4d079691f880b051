"""GRPOTrainer's held-out evaluation (``eval_dataset``): greedy completions scored by the training rewards, before the
first step, every ``eval_steps`` and after the last; logged, shown in the progress bar, plotted."""

from __future__ import annotations

import math

import pytest
import torch

from grpo_ext.trainer import GRPOConfig
from grpo_ext.trainer.demo import build_model, build_tokenizer, reversal_dataset, reversal_reward
from grpo_ext.trainer.metrics import plot_metrics
from grpo_ext.trainer.trainer import GRPOTrainer
from trainer_utils import read_metrics, small_config, without_timing

pytestmark = pytest.mark.usefixtures("one_thread")

EVAL_KEYS = ("eval/reward", "eval/completions/mean_length")


def eights(prompts, completions, answer, **_):
    """A second reward: the share of 8s in the completion; not scored (None) for answers starting with "0"."""
    return [None if a.startswith("0") else c.count("8") / 4 for c, a in zip(completions, answer, strict=True)]


def make_trainer(config: GRPOConfig, eval_rows=None, rewards=(reversal_reward,)) -> GRPOTrainer:
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, seed=0)
    train_rows, _ = reversal_dataset(seed=0)
    return GRPOTrainer(model, list(rewards), train_rows, config, tokenizer=tokenizer, eval_dataset=eval_rows)


@torch.no_grad()
def reference_eval(model, tokenizer, rows, rewards, weights, max_new_tokens) -> dict[str, float]:
    """One prompt at a time through ``transformers``' greedy ``generate`` (no padding), scored in float64."""
    eos = tokenizer.eos_token_id
    totals, lengths, per_reward = [], [], [[] for _ in rewards]
    model.eval()
    for row in rows:
        ids = torch.tensor([tokenizer(row["prompt"])["input_ids"]])
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=tokenizer.pad_token_id)
        tokens = out[0, ids.shape[1] :].tolist()
        truncated = eos not in tokens
        tokens = tokens if truncated else tokens[: tokens.index(eos) + 1]
        text = tokenizer.decode(tokens, skip_special_tokens=True)
        values = [f([row["prompt"]], [text], answer=[row["answer"]], completion_truncated=[truncated])[0]
                  for f in rewards]  # fmt: skip
        totals.append(sum(w * v for w, v in zip(weights, values, strict=True) if v is not None))
        lengths.append(len(tokens))
        for k, v in enumerate(values):
            if v is not None:
                per_reward[k].append(v)
    out = {"eval/reward": sum(totals) / len(rows), "eval/completions/mean_length": sum(lengths) / len(rows)}
    for f, values in zip(rewards, per_reward, strict=True):
        out[f"eval/rewards/{f.__name__}/mean"] = sum(values) / len(values) if values else math.nan
    return out


def test_eval_reward_is_the_weighted_reward_of_each_prompts_greedy_completion(tmp_path):
    """7 prompts in generate calls of 3 (a short last call), two rewards weighted, one of them skipping rows."""
    _, held_out = reversal_dataset(seed=0)
    rows = held_out[:7]
    rewards = (reversal_reward, eights)
    config = small_config(tmp_path, reward_weights=[1.0, 0.5], per_device_eval_batch_size=3, max_steps=2)
    trainer = make_trainer(config, rows, rewards)
    trainer.train()  # a trained model: its greedy answers differ from the initial ones'
    expected = reference_eval(trainer.model, trainer.tokenizer, rows, rewards, [1.0, 0.5], 4)
    # Both rewards score something, and the second one skipped a row (its mean is over 6 rows, not 7).
    assert expected["eval/rewards/reversal_reward/mean"] > 0 and expected["eval/rewards/eights/mean"] > 0
    assert sum(row["answer"].startswith("0") for row in rows) == 1
    got = trainer.evaluate()
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, rel=1e-12), key
    assert trainer.last_eval_reward == got["eval/reward"]


def test_eval_runs_at_the_start_every_eval_steps_and_at_the_end_without_changing_training(tmp_path):
    _, held_out = reversal_dataset(seed=0)
    with_eval = make_trainer(small_config(tmp_path / "a", max_steps=5, eval_steps=2), held_out[:6])
    history = with_eval.train()
    plain = make_trainer(small_config(tmp_path / "b", max_steps=5))
    plain_history = plain.train()

    assert [r["step"] for r in history] == [0, 1, 2, 3, 4, 5]
    assert [r["step"] for r in history if "eval/reward" in r] == [0, 2, 4, 5]
    assert set(history[0]) == {"step", *EVAL_KEYS, "eval/rewards/reversal_reward/mean"}  # before any training
    assert read_metrics(with_eval.metrics_path) == history  # logged as returned
    # Evaluation draws nothing from the training's random streams and leaves the model as it was.
    trained = [{k: v for k, v in without_timing(r).items() if not k.startswith("eval/")} for r in history[1:]]
    assert trained == [without_timing(r) for r in plain_history]
    for name, value in plain.model.state_dict().items():
        assert torch.equal(with_eval.model.state_dict()[name], value), name
    assert with_eval.model.training


def test_eval_after_a_time_stop_and_in_the_progress_bar(tmp_path, capsys):
    _, held_out = reversal_dataset(seed=0)
    trainer = make_trainer(small_config(tmp_path, max_steps=50, max_time_s=1e-6, disable_tqdm=False), held_out[:4])
    history = trainer.train()
    assert [r["step"] for r in history if "eval/reward" in r] == [0, 1]  # stopped after step 1, evaluated there
    captured = capsys.readouterr()
    assert f"eval={history[-1]['eval/reward']:.3f}" in captured.err  # the bar's postfix
    assert f"[step 1] held-out eval/reward = {history[-1]['eval/reward']:.4f} (4 prompts, greedy)" in captured.out


def test_the_plot_draws_the_held_out_reward_beside_the_training_reward(tmp_path):
    rows = [{"step": 0, "eval/reward": 0.1}, {"step": 1, "reward": 0.2, "loss": 0.0, "eval/reward": 0.3}]
    (tmp_path / "metrics.jsonl").write_text("".join(f"{r}\n".replace("'", '"') for r in rows))
    png = plot_metrics(tmp_path / "metrics.jsonl", tmp_path / "metrics.png")
    assert png.stat().st_size > 1000


def test_eval_errors(tmp_path):
    with pytest.raises(ValueError, match="eval_dataset is empty"):
        make_trainer(small_config(tmp_path), [])
    with pytest.raises(ValueError, match=r"evaluate\(\) needs an eval_dataset"):
        make_trainer(small_config(tmp_path)).evaluate()
    with pytest.raises(ValueError, match=r"GRPOConfig\.eval_steps must be >= 0"):
        small_config(tmp_path, eval_steps=-1)
    with pytest.raises(ValueError, match=r"GRPOConfig\.per_device_eval_batch_size must be None or an integer >= 1"):
        small_config(tmp_path, per_device_eval_batch_size=0)
