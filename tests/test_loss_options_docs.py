"""Every public loss function's docstring lists each loss option it takes, with its meaning from LossOptions.

The lists are generated from ``LossOptions`` (``validation/options.py``), so an option added there cannot be missing
from a docstring (issue 23, point 7: ``grpo_loss``' hand-written list had lost vespo's four options and
``skip_empty_rows``).
"""

from __future__ import annotations

import inspect
import re

import pytest

import grpo_ext
from grpo_ext import reference
from grpo_ext.nn import FusedLinearGRPOLoss
from grpo_ext.validation.options import LossOptions

LOSS_FUNCTIONS = [
    grpo_ext.grpo_loss,
    grpo_ext.grpo_loss_from_logits,
    grpo_ext.grpo_loss_from_hidden,
    reference.grpo_loss,
    reference.grpo_loss_from_logits,
    reference.grpo_loss_from_hidden,
]


def options_entry(doc: str | None, owner: str) -> str:
    """The ``**options:`` argument of a Google-style docstring: its line and every more indented line after it."""
    lines = inspect.cleandoc(doc or "").splitlines()
    at = next((i for i, line in enumerate(lines) if line.lstrip().startswith("**options:")), None)
    assert at is not None, f"{owner}'s docstring has no **options argument"
    indent = len(lines[at]) - len(lines[at].lstrip())
    end = at + 1
    while end < len(lines) and lines[end].strip() and len(lines[end]) - len(lines[end].lstrip()) > indent:
        end += 1
    return "\n".join(lines[at:end])


def meaning(name: str) -> str:
    """The start of ``name``'s line in LossOptions' ``Attributes:``, read here independently of the generator."""
    found = re.search(rf"^ {{8}}{name}: (.+)$", LossOptions.__doc__, flags=re.MULTILINE)
    assert found, f"LossOptions' docstring has no line for its field {name}"
    return " ".join(found.group(1).split())[:40]


def assert_lists(entry: str, names: list[str], owner: str) -> None:
    """Each of ``names`` has its own line in ``entry``, with its meaning; no other option is listed."""
    missing = [name for name in names if not re.search(rf"\b{name}\b", entry)]
    assert not missing, f"{owner} does not mention the options {missing}"
    flat = " ".join(entry.split())
    for name in names:
        assert re.search(rf"^\s+{name}\b", entry, flags=re.MULTILINE), f"{owner} does not list the option {name}"
        assert meaning(name) in flat, f"{owner} does not give {name}'s meaning from LossOptions"
    listed = {f for f in LossOptions._fields if re.search(rf"^\s+{f}\b", entry, flags=re.MULTILINE)}
    assert listed == set(names), f"{owner} lists options it does not take: {sorted(listed - set(names))}"


@pytest.mark.parametrize("function", LOSS_FUNCTIONS, ids=lambda f: f"{f.__module__}.{f.__name__}")
def test_every_loss_function_documents_every_option_it_takes(function):
    owner = f"{function.__module__}.{function.__name__}"
    taken = [name for name in inspect.signature(function).parameters if name in LossOptions._fields]
    assert taken == list(LossOptions._fields), f"{owner} must take every loss option"
    assert_lists(options_entry(function.__doc__, owner), taken, owner)


def test_fused_linear_module_documents_the_options_its_options_take():
    """The options ``FusedLinearGRPOLoss(**options)`` accepts (found by calling it) are the ones its docstring lists."""
    own = inspect.signature(FusedLinearGRPOLoss.__init__).parameters
    accepted = []
    for name in LossOptions._fields:
        if name in own:
            continue
        try:
            FusedLinearGRPOLoss(**{name: LossOptions._field_defaults[name]})
        except TypeError:
            continue
        accepted.append(name)
    assert {"is_weights", "vespo_k_pos", "skip_empty_rows"} <= set(accepted)
    assert_lists(options_entry(FusedLinearGRPOLoss.__doc__, "FusedLinearGRPOLoss"), accepted, "FusedLinearGRPOLoss")
