"""``grpo-ext train --config run.yaml [--key value ...]`` and ``grpo-ext demo [--key value ...]``.

A run file holds GRPOConfig fields plus ``model_name_or_path`` (a local model folder), ``dataset`` (a JSONL file
with a ``prompt`` column and any others for the rewards) and ``reward_funcs`` (built-in names ``accuracy``,
``format``, ``graded_answer``, or ``package.module:function``). ``--key value`` overrides a key; values are read
as YAML, so ``--learning_rate 1e-5``, ``--bf16 false`` and ``--reward_weights [1,0.5]`` work.

Under ``torchrun`` (``torchrun --nproc_per_node=N -m grpo_ext.trainer.cli train ...``) each process joins the
default process group (NCCL on GPUs, gloo on CPUs) and trains its share with DDP, or FSDP2 with ``--fsdp``;
``per_device_train_batch_size`` is per process.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

RUN_KEYS = ("model_name_or_path", "dataset", "reward_funcs")


@functools.cache
def _yaml_loader() -> type:
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    # Only forms with an exponent: plain integers keep resolving as ints (the int resolver runs first anyway).
    Loader.add_implicit_resolver(
        "tag:yaml.org,2002:float",
        re.compile(r"^[-+]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)[eE][-+]?[0-9]+$"),
        list("-+0123456789."),
    )
    return Loader


def load_yaml(text: str) -> Any:
    """YAML, with ``1e-5`` read as a number.

    PyYAML follows YAML 1.1, where a float needs a dot, so ``1e-5`` would stay the string ``"1e-5"`` (and a
    ``learning_rate: 1e-5`` line in a run file would be refused). YAML 1.2 reads it as a float; so do we.
    """
    import yaml

    return yaml.load(text, Loader=_yaml_loader())


def parse_overrides(tokens: Sequence[str]) -> dict[str, Any]:
    """``["--lr", "1e-5", "--flag", "true"]`` -> ``{"lr": 1e-05, "flag": True}`` (values parsed as YAML)."""
    overrides: dict[str, Any] = {}
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if not token.startswith("--") or len(token) == 2:
            raise SystemExit(f"grpo-ext: expected --key value, got {token!r}")
        key = token[2:].replace("-", "_")
        if "=" in key:
            key, raw = key.split("=", 1)
            i += 1
        elif i + 1 < len(tokens) and not tokens[i + 1].startswith("--"):
            raw = tokens[i + 1]
            i += 2
        else:
            raise SystemExit(f"grpo-ext: --{key} needs a value")
        overrides[key] = load_yaml(raw)
    return overrides


def resolve_reward(spec: str):
    """A built-in reward by name, or ``module:function``."""
    from .rewards import BUILTIN_REWARDS

    if spec in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[spec]
    if ":" not in spec:
        raise ValueError(f"unknown reward {spec!r}: use one of {', '.join(BUILTIN_REWARDS)} or module:function")
    module_name, func_name = spec.split(":", 1)
    return getattr(importlib.import_module(module_name), func_name)


def load_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a JSONL file; each must have a ``prompt`` string."""
    rows = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if not isinstance(row.get("prompt"), str):
                raise ValueError(f"{path}:{number}: every row needs a 'prompt' string")
            rows.append(row)
    return rows


def train_from_options(options: dict[str, Any], resume: str | bool | None = None) -> list[dict[str, float]]:
    """Build model, tokenizer, dataset, rewards and config from a run's options and train.

    Args:
        options: GRPOConfig fields plus ``model_name_or_path``, ``dataset`` and ``reward_funcs``.
        resume: a checkpoint folder, True for the latest in ``output_dir``, or None.

    Returns:
        The logged metrics (see :meth:`GRPOTrainer.train`).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from . import distributed
    from .config import GRPOConfig
    from .trainer import GRPOTrainer

    options = dict(options)
    missing = [key for key in RUN_KEYS if key not in options]
    if missing:
        raise ValueError(f"the run config lacks {', '.join(missing)}")
    model_path = options.pop("model_name_or_path")
    dataset_path = options.pop("dataset")
    reward_specs = options.pop("reward_funcs")
    if isinstance(reward_specs, str):
        reward_specs = [reward_specs]
    config = GRPOConfig.from_dict(options)
    created_group, device = distributed.init_from_env()  # a process group when launched by torchrun
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        model = AutoModelForCausalLM.from_pretrained(model_path)
        model.to(device)
        trainer = GRPOTrainer(
            model, [resolve_reward(s) for s in reward_specs], load_jsonl(dataset_path), config, tokenizer=tokenizer
        )
        history = trainer.train(resume_from_checkpoint=resume)
        if trainer.is_main_process:
            print(f"metrics: {trainer.metrics_path}\ncurves: {trainer.plot_path if config.plot else '(plot off)'}")
    finally:
        if created_group:
            distributed.destroy()
    return history


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``grpo-ext`` command."""
    parser = argparse.ArgumentParser(prog="grpo-ext", description="GRPO training with grpo_ext's kernels")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train a local model on a JSONL dataset")
    train.add_argument("--config", required=True, help="YAML run file")
    train.add_argument(
        "--resume", nargs="?", const=True, default=None, help="resume from the latest checkpoint (or the one given)"
    )
    train.add_argument("--fsdp", action="store_true", help="under torchrun: shard the model with FSDP2 (not DDP)")
    demo = sub.add_parser("demo", help="the embedded default: a tiny LLaMA learns to reverse digits")
    demo.add_argument("--num-threads", type=int, default=None)
    args, rest = parser.parse_known_args(argv)
    overrides = parse_overrides(rest)

    if args.command == "demo":
        from .demo import run_demo

        result = run_demo(num_threads=args.num_threads, **overrides)
        return 0 if result.learned else 1

    with open(args.config) as f:
        options = load_yaml(f.read()) or {}
    options.update(overrides)
    if args.fsdp:
        options["fsdp"] = True
    train_from_options(options, resume=args.resume)
    return 0


if __name__ == "__main__":
    sys.exit(main())
