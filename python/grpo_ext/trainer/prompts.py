"""Prompts and completions of GRPOTrainer's rollouts: their types, their text, their token ids as TRL makes them,
and the tokens that end a completion."""

from __future__ import annotations

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
