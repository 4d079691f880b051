"""The run file of ``grpo-ext train``: its YAML (``--key value`` overrides included), its reward names, its ``lora``
mapping and its JSONL datasets, each checked with an error naming the file, line or key. :mod:`.cli` runs it.
"""

from __future__ import annotations

import functools
import importlib
import itertools
import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

RUN_KEYS = ("model_name_or_path", "dataset", "reward_funcs")
OPTIONAL_RUN_KEYS = ("gguf_file", "eval_dataset", "lora")


@functools.cache
def _yaml_loader() -> type:
    import yaml

    class Loader(yaml.SafeLoader):
        def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
            """A mapping, refusing a key given twice (YAML forbids it; PyYAML would keep the last value silently).

            Keys that ``<<`` merges in may be overridden, as YAML allows; every nested mapping comes through here.
            """
            first_lines: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                line = key_node.start_mark.line + 1
                try:
                    first = first_lines.get(key)
                except TypeError:  # an unhashable key: the base class names it
                    continue
                if first is not None:
                    problem = f"duplicate key {key!r}: first on line {first}, again on line {line}"
                    raise yaml.constructor.ConstructorError(None, None, problem, key_node.start_mark)
                first_lines[key] = line
            return super().construct_mapping(node, deep=deep)

    # Only forms with an exponent: plain integers keep resolving as ints (the int resolver runs first anyway).
    Loader.add_implicit_resolver(
        "tag:yaml.org,2002:float",
        re.compile(r"^[-+]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)[eE][-+]?[0-9]+$"),
        list("-+0123456789."),
    )
    return Loader


def load_yaml(text: str) -> Any:
    """YAML, with ``1e-5`` read as a number and a key given twice in a mapping refused.

    PyYAML follows YAML 1.1, where a float needs a dot, so ``1e-5`` would stay the string ``"1e-5"`` (and a
    ``learning_rate: 1e-5`` line in a run file would be refused). YAML 1.2 reads it as a float; so do we. PyYAML
    keeps the last of duplicate keys without a word; a ``yaml.YAMLError`` names the key and both lines here.
    """
    import yaml

    return yaml.load(text, Loader=_yaml_loader())


def load_run_file(path: str | Path) -> dict[str, Any]:
    """The options of a YAML run file.

    Raises:
        ValueError: the file is missing, is not valid YAML (naming the line and column), or is not a mapping.
    """
    import yaml

    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        raise ValueError(f"{path}: no such run file (--config)") from None
    try:
        options = load_yaml(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ValueError(f"{where}: not valid YAML ({problem})") from None
    if options is None:
        return {}
    if not isinstance(options, dict):
        raise ValueError(
            f"{path}: a run file is a mapping of options, one 'key: value' per line, got a {type(options).__name__}"
        )
    return options


def parse_overrides(tokens: Sequence[str]) -> dict[str, Any]:
    """``["--lr", "1e-5", "--flag", "true"]`` -> ``{"lr": 1e-05, "flag": True}`` (values parsed as YAML)."""
    overrides: dict[str, Any] = {}
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if not token.startswith("--") or len(token) == 2:
            raise ValueError(f"expected --key value, got {token!r}")
        key = token[2:]
        if "=" in key:  # --key=value: the value is kept as given (only the key's dashes are underscores)
            key, raw = key.split("=", 1)
            i += 1
        elif i + 1 < len(tokens) and not tokens[i + 1].startswith("--"):
            raw = tokens[i + 1]
            i += 2
        else:
            raise ValueError(f"--{key} needs a value")
        key = key.replace("-", "_")
        try:
            overrides[key] = load_yaml(raw)
        except Exception as err:  # yaml.YAMLError: a value that is not YAML, or a mapping with a duplicate key
            problem = getattr(err, "problem", None) or type(err).__name__
            raise ValueError(f"--{key} {raw!r}: not a valid value ({problem})") from None
    return overrides


_REWARD_SPEC = "a reward (a built-in name or package.module:function)"


def reward_spec_list(value: Any) -> list[str]:
    """The run file's ``reward_funcs``: one reward's name or ``module:function``, or a list of them.

    Raises:
        ValueError: naming ``reward_funcs`` (and the entry) when it is something else, a number or a mapping, or an
            empty list.
    """
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list):
        raise ValueError(f"reward_funcs must be {_REWARD_SPEC} or a list of them, got {value!r} "
                         f"({type(value).__name__})")  # fmt: skip
    if not value:
        raise ValueError("reward_funcs is empty: give at least one reward")
    for i, spec in enumerate(value):
        if not isinstance(spec, str):
            raise ValueError(f"reward_funcs[{i}] must be {_REWARD_SPEC}, got {spec!r} ({type(spec).__name__})")
    return value


def resolve_reward(spec: str):
    """A built-in reward by name, ``module:function`` (an importable module), or ``path/to/file.py:function`` (a
    Python file, relative to the working directory)."""
    from .rewards import BUILTIN_REWARDS

    if isinstance(spec, str) and spec in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[spec]
    if not isinstance(spec, str) or ":" not in spec:
        raise ValueError(f"reward_funcs: unknown reward {spec!r}; use one of {', '.join(BUILTIN_REWARDS)}, "
                         "package.module:function or path/to/file.py:function")  # fmt: skip
    module_name, func_name = spec.rsplit(":", 1)
    if module_name.endswith(".py"):
        module = _import_file(module_name, spec)
    else:
        try:
            module = importlib.import_module(module_name)
        except ImportError as err:
            raise ValueError(f"reward_funcs: cannot import {module_name!r} for {spec!r} ({err})") from None
    func = getattr(module, func_name, None)
    if not callable(func):
        raise ValueError(f"reward_funcs: module {module_name!r} has no function {func_name!r}")
    return func


def _import_file(path: str, spec: str) -> Any:
    """The module of a Python file (run once per file and process: its module name is its resolved path)."""
    import importlib.util

    file = Path(path).expanduser().resolve()
    if not file.is_file():
        raise ValueError(f"reward_funcs: no file {path} for {spec!r} (a path relative to {Path.cwd()})")
    name = f"grpo_ext_reward_file_{abs(hash(str(file)))}"
    if name in sys.modules:
        return sys.modules[name]
    module_spec = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)
    except Exception as err:
        del sys.modules[name]
        raise ValueError(f"reward_funcs: importing {path} for {spec!r} failed ({type(err).__name__}: {err})") from None
    return module


def lora_config(lora: Any) -> Any:
    """``peft.LoraConfig(task_type="CAUSAL_LM", **lora)`` of the run file's ``lora`` mapping.

    Raises:
        ValueError: naming ``lora`` when it is not a mapping, peft is missing, or LoraConfig refuses a field.
    """
    if not isinstance(lora, dict):
        raise ValueError(f"lora must be a mapping of peft.LoraConfig fields (e.g. {{r: 16, lora_alpha: 32}}), got "
                         f"{lora!r} ({type(lora).__name__})")  # fmt: skip
    try:
        from peft import LoraConfig
    except ImportError:
        raise ValueError("lora needs the peft package: pip install peft") from None
    try:
        return LoraConfig(**{"task_type": "CAUSAL_LM", **lora})
    except (TypeError, ValueError) as err:
        raise ValueError(f"lora: {err}") from None


def load_jsonl(path: str | Path, key: str = "dataset") -> list[dict[str, Any]]:
    """Rows of a JSONL file; each must be an object with a ``prompt``: a string, or a list of messages
    (``{"role": ..., "content": ...}`` objects, rendered with the tokenizer's chat template).

    Args:
        path: the JSONL file.
        key: the run key that names it (``dataset`` or ``eval_dataset``), for the errors.

    Raises:
        ValueError: the file is missing or empty, or a line is not JSON or has no prompt (naming file and line).
    """
    rows = []
    if not Path(path).is_file():
        raise ValueError(f"{key}: no such file {path}")
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{number}: not a JSON line ({err.msg} at column {err.colno})") from None
            if not isinstance(row, dict) or not _is_prompt(row.get("prompt")):
                raise ValueError(f"{path}:{number}: every row needs a 'prompt' string or list of messages "
                                 '([{"role": "user", "content": "..."}])')  # fmt: skip
            rows.append(row)
    if not rows:
        raise ValueError(f"{key}: {path} has no rows")
    return rows


def jsonl_line_number(path: str | Path, row: int) -> int:
    """The line of ``path`` that holds row ``row`` of :func:`load_jsonl` (which skips blank lines)."""
    with open(path) as f:
        filled = (number for number, line in enumerate(f, 1) if line.strip())
        return next(itertools.islice(filled, row, None))


def _is_prompt(value: Any) -> bool:
    """A string, or a non-empty list of ``{"role": str, "content": ...}`` messages."""
    if isinstance(value, str):
        return True
    return isinstance(value, list) and len(value) > 0 and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m for m in value
    )
