"""Prompts and completions of GRPOTrainer's rollouts: their types, their text, their token ids as TRL makes them
(and the check that every prompt of a dataset gives some), and the tokens that end a completion."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

# A dataset row's prompt: a string, or a list of messages ``[{"role": "user", "content": ...}, ...]``.
Prompt = str | list[dict[str, Any]]
# What reward functions get for a completion: its text, or ``[{"role": "assistant", "content": text}]``.
Completion = str | list[dict[str, Any]]


def is_conversational(prompt: Any) -> bool:
    """Whether a prompt (or completion) is a list of messages (dicts with a ``role``), as TRL's
    ``is_conversational`` decides it; a string is not."""
    return isinstance(prompt, list) and len(prompt) > 0 and isinstance(prompt[0], dict) and "role" in prompt[0]


def message_text(value: Any) -> str:
    """The text of a prompt or completion: a string as it is, a list of messages as its last message's content."""
    if is_conversational(value):
        content = value[-1].get("content", "")
        return content if isinstance(content, str) else str(content)
    return value if isinstance(value, str) else str(value)


def prompt_token_ids(tokenizer: Any, prompt: Prompt) -> list[int]:
    """A prompt's token ids, as TRL's GRPOTrainer makes them.

    A list of messages goes through the tokenizer's chat template (``apply_chat_template``, which adds what the
    template holds, e.g. a BOS, and no other special tokens), with the generation prompt (the assistant's header)
    when the last message is a user's (or a tool's), continuing the last message when it is the assistant's. A
    string is tokenized as it is, with the tokenizer's special tokens (a BOS where the tokenizer adds one) and no
    chat template, even when the tokenizer has one.

    Raises:
        ValueError: a list of messages with a tokenizer that has no chat template, or a prompt of another type.
    """
    if is_conversational(prompt):
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("a prompt is a list of messages but the tokenizer has no chat_template: give a "
                             "tokenizer with one, or string prompts")  # fmt: skip
        continuing = prompt[-1].get("role") == "assistant"
        ids = tokenizer.apply_chat_template(
            prompt, tokenize=True, add_generation_prompt=not continuing, continue_final_message=continuing,
            return_dict=False,
        )  # fmt: skip
        return [int(i) for i in ids]
    if not isinstance(prompt, str):
        raise ValueError(f"a prompt must be a string or a list of messages ({{'role': ..., 'content': ...}}), got "
                         f"{prompt!r:.80} ({type(prompt).__name__})")  # fmt: skip
    return list(tokenizer(prompt)["input_ids"])


class EmptyPromptError(ValueError):
    """A dataset row whose prompt gives no tokens: ``generate`` cannot start from nothing.

    Attributes:
        dataset: the dataset's name (``train_dataset`` or ``eval_dataset``).
        row: the row's index in it.
    """

    def __init__(self, dataset: str, row: int, prompt: Any) -> None:
        super().__init__(
            f"{dataset} row {row}: its prompt {prompt!r:.80} gives no tokens (with this tokenizer and its chat "
            "template, no BOS either); generation needs at least one prompt token: give the row a prompt with text, "
            "or remove it"
        )
        self.dataset, self.row = dataset, row


def check_prompts(tokenizer: Any, rows: Sequence[Any], dataset: str) -> None:
    """Raises unless every row of ``rows`` has a prompt that gives at least one token (:func:`prompt_token_ids`).

    An empty string gives none unless the tokenizer adds a BOS; a list of messages gives what its chat template
    renders. A zero-token prompt would reach ``generate`` as an empty (or all-padding) row, which fails deep inside
    it or samples from nothing; so the dataset is refused when the trainer is built instead.

    Args:
        tokenizer: the trainer's tokenizer.
        rows: dataset rows, each a mapping with a ``prompt``.
        dataset: its name in the errors (``train_dataset``, ``eval_dataset``).

    Raises:
        EmptyPromptError: naming the first row whose prompt gives no tokens.
        ValueError: naming the first row without a ``prompt``, or whose prompt is neither a string nor a list of
            messages (or is a list of messages and the tokenizer has no chat template).
    """
    for index, row in enumerate(rows):
        if not isinstance(row, Mapping) or "prompt" not in row:
            raise ValueError(f"{dataset} row {index} has no 'prompt' (each row is a dict with a 'prompt' and the "
                             "columns the rewards take)")  # fmt: skip
        try:
            ids = prompt_token_ids(tokenizer, row["prompt"])
        except ValueError as err:
            raise ValueError(f"{dataset} row {index}: {err}") from None
        if not ids:
            raise EmptyPromptError(dataset, index, row["prompt"])


def stop_token_ids(model: Any, tokenizer: Any) -> list[int]:
    """The tokens that end a completion: the tokenizer's EOS, then the model's ``generation_config.eos_token_id``
    (an int or a list: a chat model's end-of-turn token, e.g. Llama 3's ``<|eot_id|>``, may differ from the
    tokenizer's EOS)."""
    ids = [int(tokenizer.eos_token_id)]
    config = getattr(model, "generation_config", None)
    model_eos = getattr(config, "eos_token_id", None)
    if model_eos is not None:
        for token in [model_eos] if isinstance(model_eos, int) else list(model_eos):
            if int(token) not in ids:
                ids.append(int(token))
    return ids
