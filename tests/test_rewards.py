"""The built-in reward functions against hand-computed scores; what a reward function may return."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from grpo_ext.trainer.rewards import (
    RewardFunctionError,
    accuracy_reward,
    extract_answer,
    format_reward,
    graded_answer_reward,
    make_format_reward,
    score_completions,
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


def test_demo_reversal_reward_scores_a_completion_cut_without_eos_as_too_long():
    # Decoding drops special tokens: a completion "2 <bos> 5 8" cut at the demo's 4-token cap reads "258". The demo's
    # reward scores it as 4 positions (3 right: 0.75), what "258x" gets, not as the right answer without EOS (1.0).
    from grpo_ext.trainer.demo import build_tokenizer, reversal_reward

    tokenizer = build_tokenizer()
    hidden = tokenizer.decode(tokenizer.convert_tokens_to_ids(["2", "<bos>", "5", "8"]), skip_special_tokens=True)
    assert hidden == "258"
    completions = [hidden, "2580", "25", "258", "25", "852"]
    truncated = [True, True, True, False, False, False]
    rewards = reversal_reward(["852>"] * 6, completions, ["258"] * 6, completion_truncated=truncated)
    expected = [
        3 / 4,  # three right, cut at the cap: 4 positions
        3 / 4,  # three right out of max(3, 4)
        2 / 4,  # two right, cut at the cap after a hidden token (or two): still 4 positions
        1.0 + 0.5,  # all right, stopped at the right length
        2 / 3,  # two right, stopped early
        1 / 3 + 0.5,  # the middle one right, right length
    ]
    assert rewards == pytest.approx(expected)
    assert reversal_reward(["852>"], ["258"], ["258"]) == pytest.approx([1.5])  # no truncation flags: none cut


def returning(values):
    """A reward function named ``fixed`` that returns ``values`` whatever it is given."""

    def fixed(prompts, completions, **columns):
        return values

    return fixed


def score(values, n: int = 3) -> torch.Tensor:
    return score_completions([returning(values)], ["fixed"], ["p"] * n, ["c"] * n, {})


# TRL takes any sequence of numbers (torch.tensor(output, dtype=float32), None as NaN): so do we.
NUMBER_SEQUENCES = {
    "list": lambda: [0.5, None, -2.0],
    "tuple": lambda: (0.5, None, -2.0),
    "numpy float64": lambda: np.array([0.5, np.nan, -2.0]),
    "numpy float32": lambda: np.array([0.5, np.nan, -2.0], dtype=np.float32),
    "numpy object with None": lambda: np.array([0.5, None, -2.0], dtype=object),
    "tensor": lambda: torch.tensor([0.5, float("nan"), -2.0], dtype=torch.float64),
    "bfloat16 tensor": lambda: torch.tensor([0.5, float("nan"), -2.0], dtype=torch.bfloat16),
    "scalars of numpy and torch": lambda: [np.float64(0.5), None, torch.tensor(-2.0)],
}


@pytest.mark.parametrize("kind", NUMBER_SEQUENCES)
def test_score_completions_takes_any_sequence_of_numbers(kind):
    rewards = score(NUMBER_SEQUENCES[kind]())
    assert rewards.dtype == torch.float32 and rewards.shape == (3, 1)
    expected = torch.tensor([[0.5], [float("nan")], [-2.0]], dtype=torch.float64)
    torch.testing.assert_close(rewards.double(), expected, equal_nan=True, rtol=0, atol=0)


def test_score_completions_takes_integers_and_booleans_as_numbers():
    torch.testing.assert_close(score(np.array([1, 0, 3])), torch.tensor([[1.0], [0.0], [3.0]]))
    torch.testing.assert_close(score([True, False, np.bool_(True)]), torch.tensor([[1.0], [0.0], [1.0]]))


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ("abc", r"reward function fixed returned str 'abc'"),
        (b"abc", r"reward function fixed returned bytes"),
        (["1.0", 2.0, 3.0], r"reward function fixed returned '1\.0' \(str\) for row 0"),
        ([1.0, [2.0], 3.0], r"reward function fixed returned \[2\.0\] \(list\) for row 1"),
        ([[1.0], [2.0], [3.0]], r"reward function fixed returned \[1\.0\] \(list\) for row 0"),
        ([1.0, torch.tensor([2.0]), 3.0], r"reward function fixed returned tensor\(\[2\.\]\) \(Tensor\) for row 1"),
        (np.array(["1", "2", "3"]), r"reward function fixed returned '1' \(str\) for row 0"),
        (torch.ones(3, 1), r"reward function fixed returned a Tensor of shape \(3, 1\)"),
        (np.ones((3, 1)), r"reward function fixed returned a ndarray of shape \(3, 1\)"),
        (torch.tensor(1.0), r"reward function fixed returned a Tensor of shape \(\)"),
        ({0: 1.0, 1: 2.0, 2: 3.0}, r"reward function fixed returned dict"),
        ([1.0, 2.0 + 1j, 3.0], r"reward function fixed returned \(2\+1j\) \(complex\) for row 1"),
        ([1.0, -(10**400), 3.0], r"reward function fixed returned -100000000000000000000000000000000000000\.\.\. for "
                                 r"row 1 .*a reward must be finite"),
        ([1.0, 2.0, 1e39], r"reward function fixed returned 1e\+39 for row 2 .*within float32's range"),
        ([np.float64(-3.5e38), 2.0, 3.0], r"reward function fixed returned -3\.5e\+38 for row 0"),
    ],
    ids=["str", "bytes", "str entry", "nested entry", "nested list", "1-D tensor entry", "numpy strings",
         "[N, 1] tensor", "[N, 1] array", "0-dim tensor", "dict", "complex entry", "int beyond float64",
         "beyond float32", "numpy beyond float32"],
)  # fmt: skip
def test_score_completions_refuses_strings_and_nested_values_naming_the_function(values, message):
    with pytest.raises(ValueError, match=message):
        score(values)


def test_the_largest_float32_is_a_reward():
    largest = float(torch.finfo(torch.float32).max)
    torch.testing.assert_close(score([largest, -largest, 10**38]).double(),
                               torch.tensor([[largest], [-largest], [1e38]], dtype=torch.float64))  # fmt: skip


def test_a_reward_function_that_raises_is_named_with_the_exception():
    class Scorer:
        def score(self, prompts, completions, **columns):
            return [float(columns["answer"][0])] * len(completions)  # no answer column: KeyError

    with pytest.raises(RewardFunctionError) as raised:
        score_completions([Scorer().score], ["score"], ["p"] * 3, ["c"] * 3, {})
    assert str(raised.value) == (
        "reward function 'test_a_reward_function_that_raises_is_named_with_the_exception.<locals>.Scorer.score' "
        "raised KeyError: 'answer'"
    )
    assert isinstance(raised.value.__cause__, KeyError)

    def silent(prompts, completions, **columns):
        raise OverflowError

    with pytest.raises(RewardFunctionError, match=r"^reward function '.*\.silent' raised OverflowError: \(no message"):
        score_completions([silent], ["silent"], ["p"], ["c"], {})
