"""examples/smollm2_sums: its committed data are what the script writes, its reward scores what it says, and its
run file is a valid ``grpo-ext train`` run (the model itself is never loaded here: see ``make demo-real``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from grpo_ext.trainer import GRPOConfig
from grpo_ext.trainer.run_file import OPTIONAL_RUN_KEYS, RUN_KEYS, load_jsonl, load_run_file, resolve_reward

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
import smollm2_sums  # noqa: E402


def test_the_committed_data_are_the_scripts_disjoint_sums():
    train, held_out = smollm2_sums.sum_rows()
    assert load_jsonl(smollm2_sums.DATA_DIR / "train.jsonl") == train
    assert load_jsonl(smollm2_sums.DATA_DIR / "held_out.jsonl") == held_out
    assert (len(train), len(held_out)) == (smollm2_sums.NUM_TRAIN, smollm2_sums.NUM_HELD_OUT)
    questions = [[row["prompt"][0]["content"] for row in rows] for rows in (train, held_out)]
    assert not set(questions[0]) & set(questions[1])  # never trained on
    for row in train + held_out:
        a, b = map(int, [w for w in row["prompt"][0]["content"].replace("?", " ").split() if w.isdigit()])
        assert 10 <= a <= 99 and 10 <= b <= 99 and row["answer"] == a + b


@pytest.mark.parametrize("as_messages", [False, True])
def test_the_reward_is_one_when_the_last_number_is_the_sum(as_messages):
    texts = ["57", "The answer is 57.", "57 is 12 + 45... no, 56", "fifty-seven", "", "-57", "12 + 45 = 57"]
    completions = [[{"role": "assistant", "content": t}] for t in texts] if as_messages else texts
    assert smollm2_sums.correct([None] * 7, completions, [57] * 7) == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0]


def test_the_run_file_is_a_valid_run(monkeypatch):
    options = load_run_file(smollm2_sums.RUN_FILE)
    assert set(RUN_KEYS) <= set(options)
    run_keys = set(RUN_KEYS) | set(OPTIONAL_RUN_KEYS)
    config = GRPOConfig.from_dict({k: v for k, v in options.items() if k not in run_keys})
    assert config.eval_steps > 0 and config.max_time_s is not None
    # Running the README's command again must not delete the last run's final_model: the default refusal stays.
    assert config.overwrite_output_dir is False
    monkeypatch.chdir(ROOT)  # paths in the run file are relative to the repository root
    assert [row["answer"] for row in load_jsonl(options["eval_dataset"])] == [
        row["answer"] for row in smollm2_sums.sum_rows()[1]
    ]
    reward = resolve_reward(options["reward_funcs"])
    assert reward([None], ["58"], [58]) == [1.0]
    assert json.loads(json.dumps(options))["gguf_file"] == smollm2_sums.GGUF_FILE
