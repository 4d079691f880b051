"""The built-in reward functions against hand-computed scores."""

from __future__ import annotations

import pytest

from grpo_ext.trainer.rewards import (
    accuracy_reward,
    extract_answer,
    format_reward,
    graded_answer_reward,
    make_format_reward,
)


def test_extract_answer_prefers_boxed_then_answer_tag_then_whole_text():
    assert extract_answer(r"so \boxed{3} or rather \boxed{ 4 }") == "4"
    assert extract_answer("<think>x</think><answer> 12\n</answer>") == "12"
    assert extract_answer("  7   8 ") == "7 8"


def test_accuracy_reward_exact_answers():
    completions = [r"The answer is \boxed{42}.", "<answer>41</answer>", "42", "forty-two", "anything"]
    answers = ["42", "41", " 42 ", "42", None]
    assert accuracy_reward(["q"] * 5, completions, answer=answers) == [1.0, 1.0, 1.0, 0.0, None]


def test_accuracy_reward_reads_the_solution_column_and_needs_one():
    assert accuracy_reward(["q"], ["5"], solution=["5"]) == [1.0]
    with pytest.raises(ValueError, match="answer"):
        accuracy_reward(["q"], ["5"])


def test_format_reward_matches_open_r1_pattern():
    good = "<think>\nsome reasoning\n</think>\n<answer>\n42\n</answer>"
    missing_newline = "<think>some reasoning</think>\n<answer>\n42\n</answer>"
    trailing_text = good + " and more"
    no_think = "<answer>\n42\n</answer>"
    assert format_reward(["q"] * 4, [good, missing_newline, trailing_text, no_think]) == [1.0, 0.0, 0.0, 0.0]


def test_make_format_reward_custom_pattern():
    reward = make_format_reward(r"^\d+$")
    assert reward(["q", "q"], ["123", "12a"]) == [1.0, 0.0]


def test_graded_answer_reward_partial_credit_and_stop_bonus():
    completions = ["321", "320", "3210", "3", "", "321"]
    truncated = [False, False, True, False, False, True]
    rewards = graded_answer_reward(["123>"] * 6, completions, ["321"] * 6, truncated)
    expected = [
        1.0 + 0.2,  # all right, stopped at the right length
        2 / 3 + 0.2,  # two right, right length
        3 / 4,  # three right out of max(3, 4), no EOS: no bonus
        1 / 3,  # one right, stopped too early
        0.0,
        1.0,  # right text but truncated (no EOS): no bonus
    ]
    assert rewards == pytest.approx(expected)
