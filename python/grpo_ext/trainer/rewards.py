"""Built-in reward functions.

A reward function is a callable ``f(prompts, completions, **columns) -> list[float | None]``: ``prompts`` and
``completions`` are lists of the same length (one entry per completion, the prompt repeated for each of its ``G``
completions); as in TRL, a completion is a string for a string prompt and ``[{"role": "assistant", "content":
text}]`` for a prompt that is a list of messages (the built-in rewards take both). ``columns`` holds the dataset's
other columns aligned the same way, plus ``completion_truncated`` (True where the completion hit
``max_completion_length`` without EOS). It may return a list, a tuple, a 1-D tensor or a 1-D NumPy array of
numbers, as TRL takes them. ``None`` means "not scored" and
becomes NaN (ignored by the advantage normalization); a NaN value counts the same. Anything else that is not a
finite number (+-inf, a number beyond float32's range, a string, a nested list, a missing list) is an error naming
the function, and so is an exception it raises (:func:`score_completions`).
"""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# open-r1's format: reasoning inside <think>, the answer inside <answer>, each tag on its own line.
THINK_ANSWER_PATTERN = r"^<think>\n.*?\n</think>\n<answer>\n.*?\n</answer>$"

_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def completion_text(completion: Any) -> str:
    """A completion's text: a string as it is, a list of messages (a conversational completion) as its last
    message's content."""
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        return str(completion[-1].get("content", ""))
    return completion


def extract_answer(completion: str) -> str:
    """The answer part of a completion: the last ``\\boxed{...}``, else the last ``<answer>...</answer>``, else all.

    Whitespace is stripped and inner runs of whitespace collapsed, so ``" 4 2 "`` and ``"4 2"`` compare equal.
    """
    boxed = _BOXED.findall(completion)
    if boxed:
        text = boxed[-1]
    else:
        tagged = _ANSWER_TAG.findall(completion)
        text = tagged[-1] if tagged else completion
    return " ".join(text.split())


def accuracy_reward(
    prompts: Sequence[str], completions: Sequence[str], answer: Sequence[Any] | None = None, **columns: Any
) -> list[float | None]:
    """1.0 where the completion's extracted answer equals the reference answer exactly, else 0.0.

    Args:
        prompts: ``[N]`` prompt strings (unused).
        completions: ``[N]`` completion strings.
        answer: ``[N]`` reference answers (column ``answer``; ``solution`` is accepted too); a None answer gives a
            None reward (not scored).
        **columns: other dataset columns (ignored).

    Returns:
        ``[N]`` floats in {0.0, 1.0} or None.
    """
    if answer is None:
        answer = columns.get("solution")
    if answer is None:
        raise ValueError("accuracy_reward needs an 'answer' (or 'solution') column in the dataset")
    rewards: list[float | None] = []
    for completion, reference in zip(completions, answer, strict=True):
        if reference is None:
            rewards.append(None)
        else:
            rewards.append(float(extract_answer(completion_text(completion)) == " ".join(str(reference).split())))
    return rewards


def make_format_reward(pattern: str = THINK_ANSWER_PATTERN, flags: int = re.DOTALL | re.MULTILINE) -> Callable:
    """A reward of 1.0 where the whole completion matches ``pattern`` (``re.match``), else 0.0."""
    compiled = re.compile(pattern, flags)

    def format_reward(prompts: Sequence[str], completions: Sequence[str], **columns: Any) -> list[float]:
        return [1.0 if compiled.match(completion_text(completion)) else 0.0 for completion in completions]

    return format_reward


format_reward = make_format_reward()
format_reward.__doc__ = (
    "1.0 where the completion is ``<think>\\n...\\n</think>\\n<answer>\\n...\\n</answer>``, else 0.0."
)


def graded_answer_reward(
    prompts: Sequence[str],
    completions: Sequence[str],
    answer: Sequence[str],
    completion_truncated: Sequence[bool] | None = None,
    stop_bonus: float = 0.2,
    **columns: Any,
) -> list[float]:
    """The demo task's graded reward: partial credit per position plus a bonus for stopping at the right length.

    ``correct positions / max(len(answer), len(completion))`` plus ``stop_bonus`` when the completion ended with EOS
    (not truncated) at exactly the answer's length. The bonus keeps a confident model trying EOS: three right
    digits and a junk fourth already score 0.75 otherwise.

    Args:
        prompts: ``[N]`` prompt strings (unused).
        completions: ``[N]`` completion strings (special tokens removed).
        answer: ``[N]`` reference answers.
        completion_truncated: ``[N]`` True where generation hit the length cap without EOS (default: none).
        stop_bonus: added for a correct-length, EOS-terminated completion.
        **columns: other dataset columns (ignored).

    Returns:
        ``[N]`` floats in ``[0, 1 + stop_bonus]``.
    """
    if completion_truncated is None:
        completion_truncated = [False] * len(completions)
    rewards = []
    for completion, target, truncated in zip(completions, answer, completion_truncated, strict=True):
        text, target = completion_text(completion).strip(), str(target)
        correct = sum(a == b for a, b in zip(text, target, strict=False))
        score = correct / max(len(target), len(text), 1)
        if not truncated and len(text) == len(target):
            score += stop_bonus
        rewards.append(score)
    return rewards


BUILTIN_REWARDS: dict[str, Callable] = {
    "accuracy": accuracy_reward,
    "format": format_reward,
    "graded_answer": graded_answer_reward,
}


#: The largest reward magnitude: rewards are stored as float32, where a larger finite number would become inf.
MAX_REWARD = 3.4028234663852886e38  # torch.finfo(torch.float32).max


class RewardFunctionError(RuntimeError):
    """A reward function raised: the message names the function (its qualified name) and the exception's type and
    message; the original exception is ``__cause__``."""


def _qualified_name(func: Callable, name: str) -> str:
    """``func``'s ``__qualname__`` (``Class.method``, ``factory.<locals>.reward``), else its logged name."""
    qualname = getattr(func, "__qualname__", None)
    return qualname if isinstance(qualname, str) and qualname else name


def _reward_values(values: Any, name: str, count: int) -> list:
    """The ``count`` entries a reward function returned: a list or tuple, a 1-D tensor or NumPy array.

    Raises:
        ValueError: naming the function and what it returned (a string, None, a generator, a 2-D array, ...).
    """
    shape = getattr(values, "shape", None)
    if shape is not None and hasattr(values, "tolist"):  # a tensor or an array (TRL takes any sequence of numbers)
        if len(shape) != 1:
            raise ValueError(f"reward function {name} returned a {type(values).__name__} of shape {tuple(shape)}; "
                             f"it must return {count} numbers, one per completion (a 1-D tensor or array)")  # fmt: skip
        values = values.tolist()  # Python numbers (or the entries of an object array)
    elif not isinstance(values, Sequence) or isinstance(values, (str, bytes)):
        kind = "None" if values is None else type(values).__name__
        shown = f" {values[:40]!r}" if isinstance(values, (str, bytes)) else ""
        raise ValueError(f"reward function {name} returned {kind}{shown}; it must return {count} numbers (a list, a "
                         "tuple, a 1-D tensor or array; None for a completion it does not score)")  # fmt: skip
    if len(values) != count:
        raise ValueError(f"reward function {name} returned {len(values)} values for {count} completions")
    return list(values)


def _reward_number(value: Any) -> float | None:
    """``value`` as a float (NaN for None), or None when it is not a real number: a number of Python, NumPy or a
    0-dim tensor, a bool included (as TRL). A string is not a number here, even ``"1.0"``."""
    if value is None:
        return math.nan
    if getattr(value, "shape", None) == () and hasattr(value, "item"):  # a 0-dim tensor or array, a NumPy scalar
        value = value.item()
    if isinstance(value, numbers.Real):  # bool, int, float, NumPy's registered scalar types
        try:
            return float(value)
        except OverflowError:  # an int (or Fraction) beyond float64, e.g. 10**400: infinite as far as we can tell
            return math.inf if value > 0 else -math.inf
    return None


def score_completions(
    reward_funcs: Sequence[Callable], names: Sequence[str], prompts: list[str], completions: list[str],
    columns: dict[str, list],
) -> torch.Tensor:
    """Every reward function on ``N`` completions: ``rewards [N, K]`` float32 (NaN: not scored).

    A function returns ``N`` values, one per completion, as TRL takes them: a list, a tuple, a 1-D tensor or a 1-D
    NumPy array, each entry a real number (a bool, a NumPy scalar or a 0-dim tensor too) or None (not scored; NaN
    counts the same).

    Raises:
        RewardFunctionError: a reward function raised; naming it (its qualified name), the exception's type and
            its message.
        ValueError: naming the reward function (and the row) when it returns something else: None, a string, a
            generator or another non-sequence, a tensor or array that is not 1-D, the wrong count, an entry that is
            not a number (a string, a list: one number per completion), or +-inf or a number beyond float32's range
            (``10**400``, ``1e39``; not a reward: fix the function, or return None for a completion it cannot score).
    """
    import torch

    rewards = torch.empty(len(completions), len(reward_funcs), dtype=torch.float32)
    for k, (func, name) in enumerate(zip(reward_funcs, names, strict=True)):
        try:
            returned = func(prompts, completions, **columns)
        except Exception as err:  # a user's function: anything (a KeyboardInterrupt, a signal's stop, passes)
            message = next((line.strip() for line in str(err).splitlines() if line.strip()), "(no message)")
            raise RewardFunctionError(f"reward function {_qualified_name(func, name)!r} raised "
                                      f"{type(err).__name__}: {message}") from err  # fmt: skip
        values = _reward_values(returned, name, len(completions))
        for row, value in enumerate(values):
            number = _reward_number(value)
            if number is None:
                raise ValueError(f"reward function {name} returned {value!r} ({type(value).__name__}) for row {row}; "
                                 "each entry must be a number, or None when not scored")  # fmt: skip
            if math.isinf(number) or abs(number) > MAX_REWARD:
                shown = f"{value!r:.40}..." if isinstance(value, int) and len(repr(value)) > 40 else f"{number}"
                raise ValueError(
                    f"reward function {name} returned {shown} for row {row} (completion {completions[row][:80]!r}); "
                    "a reward must be finite (and within float32's range, |r| <= 3.4e38): fix the function, or "
                    "return None for a completion it cannot score"
                )
            rewards[row, k] = number
    return rewards
