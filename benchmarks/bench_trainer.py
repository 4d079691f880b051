"""Benchmark of one full GRPO training step: grpo_ext's trainer (plain / fused log-probs), TRL's, GRPOExtTrainer.

Each contender runs in a fresh process (so that its peak memory is its own) on the same tiny random-init Qwen2-style
model (hidden 256, 2 layers, 4 heads, untied LM head, float32 on the CPU, or the shape --hidden, --layers, --heads,
--kv-heads and --intermediate give; built in the script, nothing downloaded) and the
same batch (``--batch`` completions, ``num_generations`` 4, prompts of ``--prompt-length`` tokens, completions of
exactly ``T`` tokens, ``loss_type="dapo"``, ``beta=0``, one micro-batch per step). Contenders:

* ``grpo_ext/<backend>``: :class:`grpo_ext.trainer.GRPOTrainer` with ``GRPOConfig(logps_backend=<backend>)``, for
  ``plain`` and ``fused``; a backend the installed GRPOConfig does not accept is reported n/a, and then the backends it
  does accept are run instead (so the script measures whatever exists in the checkout);
* ``trl``: TRL 1.16's own ``trl.GRPOTrainer``, unpatched;
* ``trl+grpo_ext/<backend>``: ``grpo_ext.integrations.trl.GRPOExtTrainer(logps_backend=<backend>)``.

Two figures per contender, case by case:

* ``step``: forward, backward, gradient clipping and the AdamW update of one step on a fixed batch (generation
  excluded), median of ``--steps`` timed steps after one warm-up step;
* ``gen+step``: the same contender's own generation of a batch (``T`` new tokens at most, sampling) and scoring, then
  the step on it (generation included), timed once.

Peak memory, ``peak MiB``: on the CPU the process's peak RSS during the timed steps above its RSS just before them
(Linux ``VmHWM`` reset through ``/proc/self/clear_refs``; glibc is told to return large blocks to the system), so
the model, its gradients and the optimizer state, allocated by the warm-up step, are not counted; on CUDA the
allocator's peak above what was allocated before. ``--max-logits-gib`` skips a contender (n/a) whose step would
hold the ``[B, P + T, V]`` float32 logits above that size (the plain path on a small machine).

Usage::

    python benchmarks/bench_trainer.py           # V in {32000, 151936} x T in {256, 1024}
    python benchmarks/bench_trainer.py --quick   # smoke run (CI): V=512, T=16, hidden 32
    python benchmarks/bench_trainer.py --vocabs 151936 --lengths 1024 --contenders grpo_ext/fused,trl
    python benchmarks/bench_trainer.py --contenders trl,trl+grpo_ext/fused --options top_entropy_quantile=0.2

``--gradient-checkpointing on|off|both`` (default off, as the rows of RESULTS.md were measured): ``on`` turns on
transformers' activation checkpointing (``use_reentrant=False``) for every contender, ``GRPOConfig``'s
``gradient_checkpointing`` for grpo_ext's trainer and what ``transformers.Trainer.train()`` does with TRL's for
the others (this script calls TRL's loss itself, so TRL's own default of on never applies here); such a row's impl
ends in ``+ckpt``. ``both`` gives each contender both rows, so the peak's fall reads off one table (the gradient-norm
check compares them too: checkpointing changes no result).

``--options KEY=VALUE,...`` sets loss options of every contender's config (TRL's names: ``entropy_coef``,
``top_entropy_quantile``, ``off_policy_mask_threshold``, ...); a grpo_ext trainer contender whose GRPOConfig lacks
one is reported n/a. The fixed batch has no old log-probs, so ``off_policy_mask_threshold`` keeps every row (the
sampling log-probs are the current ones) while still computing its mask.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # for `harness`, wherever run from

import torch

from harness import cli, environment, reporting

BACKENDS = ("plain", "fused")
CONTENDERS = ("grpo_ext/plain", "grpo_ext/fused", "trl", "trl+grpo_ext/fused", "trl+grpo_ext/plain")
NUM_GENERATIONS = 4
RESULT_PREFIX = "RESULT "
SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")


# ---------------------------------------------------------------------------------------------------------------
# the child: one contender, one case
# ---------------------------------------------------------------------------------------------------------------


def build_tokenizer(vocab: int):
    """A word-level tokenizer over ``vocab`` tokens ``<pad> <bos> <eos> <unk> w4 ... w{V-1}`` (space separated)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    words.update({f"w{i}": i for i in range(len(SPECIAL_TOKENS), vocab)})
    core = Tokenizer(models.WordLevel(vocab=words, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.decoder = decoders.WordPiece(prefix="##")  # joins with spaces
    return PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>", unk_token="<unk>",
        padding_side="left",
    )  # fmt: skip


def build_model(case: dict[str, Any], tokenizer, device: torch.device):
    """The tiny random-init Qwen2 causal LM of the case (seeded, float32)."""
    import transformers

    config = transformers.Qwen2Config(
        vocab_size=case["vocab"], hidden_size=case["hidden"],
        intermediate_size=case.get("intermediate") or 2 * case["hidden"], num_hidden_layers=case["layers"],
        num_attention_heads=case.get("heads", 4), num_key_value_heads=case.get("kv_heads", 2),
        max_position_embeddings=case["prompt_length"] + case["length"] + 8, tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    torch.manual_seed(case["seed"])
    return transformers.Qwen2ForCausalLM(config).to(device)


def prompts_of(case: dict[str, Any]) -> list[str]:
    """``batch / G`` distinct prompts of ``prompt_length`` words."""
    count = case["batch"] // NUM_GENERATIONS
    return [" ".join(f"w{4 + (7 * p + i) % 50}" for i in range(case["prompt_length"])) for p in range(count)]


def fixed_batch(case: dict[str, Any], device: torch.device) -> dict[str, torch.Tensor]:
    """The step's batch: full prompts and full completions of ``T`` random tokens, advantages of both signs."""
    g = torch.Generator().manual_seed(case["seed"] + 1)
    rows, vocab = case["batch"], case["vocab"]
    prompt_ids = torch.randint(len(SPECIAL_TOKENS), vocab, (rows, case["prompt_length"]), generator=g)
    completion_ids = torch.randint(len(SPECIAL_TOKENS), vocab, (rows, case["length"]), generator=g)
    advantages = torch.randn(rows, generator=g)
    batch = dict(
        prompt_ids=prompt_ids, prompt_mask=torch.ones_like(prompt_ids), completion_ids=completion_ids,
        completion_mask=torch.ones_like(completion_ids, dtype=torch.bool), advantages=advantages,
    )  # fmt: skip
    return {name: value.to(device) for name, value in batch.items()}


def reward(prompts, completions, **columns) -> list[float]:
    return [float(len(c) % 7) for c in completions]


def grpo_ext_runner(case: dict[str, Any], backend: str, model, tokenizer, device: torch.device, out_dir: str):
    """(step on the fixed batch, generation + step) of grpo_ext's own trainer."""
    import dataclasses

    from grpo_ext.trainer import GRPOConfig, GRPOTrainer

    options = dict(case["options"])
    if "gradient_checkpointing" in {field.name for field in dataclasses.fields(GRPOConfig)}:
        options["gradient_checkpointing"] = case["checkpointing"]  # (select_contenders: n/a when on and absent)
    config = GRPOConfig(
        output_dir=out_dir, logps_backend=backend, per_device_train_batch_size=case["batch"],
        num_generations=NUM_GENERATIONS, max_completion_length=case["length"], max_prompt_length=None,
        gradient_accumulation_steps=1, beta=0.0, loss_type="dapo", learning_rate=1e-5, report_to="none",
        bf16=False, save_steps=0, plot=False, log_completions=False, **options,
    )  # fmt: skip
    dataset = [{"prompt": p} for p in prompts_of(case)]
    trainer = GRPOTrainer(model, reward, dataset, config=config, tokenizer=tokenizer)
    batch = fixed_batch(case, device)
    micro = dict(batch, zero_std=torch.zeros(case["batch"], dtype=torch.bool, device=device), old_logps=None,
                 ref_logps=None)  # fmt: skip

    def step() -> float:
        trainer._micro_batches = [micro]
        return float(trainer._training_step()["grad_norm"])

    def generate_and_step() -> float:
        trainer._micro_batches = []
        return float(trainer._training_step()["grad_norm"])  # generates when the queue is empty

    return step, generate_and_step


def trl_runner(case: dict[str, Any], backend: str | None, model, tokenizer, device: torch.device, out_dir: str):
    """(step on the fixed batch, generation + step) of TRL's GRPOTrainer, or of GRPOExtTrainer with ``backend``."""
    import trl
    from datasets import Dataset

    args = trl.GRPOConfig(
        output_dir=out_dir, report_to="none", use_cpu=device.type == "cpu", bf16=False, seed=case["seed"],
        per_device_train_batch_size=case["batch"], num_generations=NUM_GENERATIONS,
        max_completion_length=case["length"], gradient_accumulation_steps=1, steps_per_generation=1, beta=0.0,
        loss_type="dapo", learning_rate=1e-5, save_strategy="no", disable_tqdm=True,
        gradient_checkpointing=case["checkpointing"], **case["options"],
    )  # fmt: skip
    dataset = Dataset.from_dict({"prompt": prompts_of(case)})
    kwargs = dict(model=model, reward_funcs=reward, args=args, train_dataset=dataset, processing_class=tokenizer)
    if backend is None:
        trainer = trl.GRPOTrainer(**kwargs)
    else:
        from grpo_ext.integrations.trl import GRPOExtTrainer

        trainer = GRPOExtTrainer(logps_backend=backend, **kwargs)
    if case["checkpointing"]:  # what transformers' Trainer.train() does with TRL's gradient_checkpointing
        enable_checkpointing(trainer.model)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by transformers' loop, read by TRL's loss
    trainer.create_optimizer()
    batch = fixed_batch(case, device)
    fixed = dict(batch, completion_mask=batch["completion_mask"].long(),
                 num_items_in_batch=batch["completion_mask"].sum())  # fmt: skip
    rows = [{"prompt": p} for p in prompts_of(case) for _ in range(NUM_GENERATIONS)]

    def train_on(inputs) -> float:
        loss = trainer.compute_loss(trainer.model, inputs)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(trainer.model.parameters(), args.max_grad_norm)
        trainer.optimizer.step()
        trainer.optimizer.zero_grad(set_to_none=True)
        return float(grad_norm)

    def generate_and_step() -> float:
        trainer.model.eval()
        inputs = trainer._generate_and_score_completions(rows)
        trainer.model.train()
        return train_on(inputs)

    return (lambda: train_on(fixed)), generate_and_step


def enable_checkpointing(model) -> None:
    """transformers' activation checkpointing of ``model``'s layers with ``use_reentrant=False``, as
    ``transformers.Trainer.train()`` enables it (``gradient_checkpointing_enable`` before transformers 5)."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def _rss_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_child(case: dict[str, Any]) -> dict[str, Any]:
    """Builds the contender, runs one warm-up step, then times ``steps`` steps and one generation + step.

    Returns:
        ``step_ms`` (median), ``gen_step_ms`` (None without ``generation``), ``peak_bytes`` above ``base_bytes``
        (RSS or allocated before the timed steps), and ``grad_norm``: the gradient norm of the warm-up step (same
        parameters and batch everywhere).
    """
    device = torch.device(case["device"])
    torch.manual_seed(case["seed"])
    tokenizer = build_tokenizer(case["vocab"])
    model = build_model(case, tokenizer, device)
    family, _, backend = case["contender"].partition("/")
    with tempfile.TemporaryDirectory() as out_dir:
        if family == "grpo_ext":
            step, generate_and_step = grpo_ext_runner(case, backend, model, tokenizer, device, out_dir)
        else:
            step, generate_and_step = trl_runner(case, backend or None, model, tokenizer, device, out_dir)
        grad_norm = step()  # warm-up: the optimizer state and the allocator's pools exist from here on
        _sync(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
        else:
            before = _rss_bytes("VmRSS")
            Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
        times = []
        for _ in range(case["steps"]):
            start = time.perf_counter()
            step()
            _sync(device)
            times.append(1e3 * (time.perf_counter() - start))
        peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else _rss_bytes("VmHWM")
        total_ms = None
        if case["generation"]:
            start = time.perf_counter()
            generate_and_step()
            _sync(device)
            total_ms = 1e3 * (time.perf_counter() - start)
    return dict(step_ms=statistics.median(times), gen_step_ms=total_ms, peak_bytes=max(0, peak - before),
                base_bytes=before, grad_norm=grad_norm)  # fmt: skip


# ---------------------------------------------------------------------------------------------------------------
# the parent: one fresh process per contender and case
# ---------------------------------------------------------------------------------------------------------------


def accepted_backends() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``(the values of BACKENDS grpo_ext's GRPOConfig accepts as logps_backend, its other accepted values)``."""
    from grpo_ext.trainer import GRPOConfig

    def accepts(value: str) -> bool:
        try:
            GRPOConfig(logps_backend=value)
        except (TypeError, ValueError):
            return False
        return True

    if not hasattr(GRPOConfig(), "logps_backend"):
        return (), ()
    return tuple(v for v in BACKENDS if accepts(v)), tuple(v for v in ("torch", "grpo_ext") if accepts(v))


def parse_options(text: str | None) -> dict[str, Any]:
    """``KEY=VALUE,...`` as config overrides: numbers as numbers, ``true``/``false`` as bools, the rest as text."""
    options: dict[str, Any] = {}
    for item in cli.parse_list(text or ""):
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--options takes KEY=VALUE items, got {item!r}")
        try:
            options[key] = json.loads(value.lower() if value.lower() in ("true", "false") else value)
        except json.JSONDecodeError:
            options[key] = value
    return options


def select_contenders(
    requested: list[str], options: dict[str, Any], checkpointing: bool = False
) -> tuple[list[str], dict[str, str]]:
    """The contenders to run, and those that cannot run in this checkout with the reason (GRPOConfig's backends and
    fields; ``checkpointing`` needs its ``gradient_checkpointing``)."""
    import dataclasses

    from grpo_ext.trainer import GRPOConfig

    found, others = accepted_backends()
    needed = set(options) | ({"gradient_checkpointing"} if checkpointing else set())
    lacking = sorted(needed - {field.name for field in dataclasses.fields(GRPOConfig)})
    run: list[str] = []
    missing: dict[str, str] = {}
    for name in requested:
        if name not in CONTENDERS:
            raise SystemExit(f"unknown contender {name!r}: one of {', '.join(CONTENDERS)}")
        backend = name.removeprefix("grpo_ext/")
        if name.startswith("grpo_ext/") and backend not in found:
            missing[name] = f"grpo_ext's GRPOConfig does not accept logps_backend={backend!r} in this checkout"
        elif name.startswith("grpo_ext/") and lacking:
            missing[name] = f"grpo_ext's GRPOConfig has no {', '.join(lacking)}"
        else:
            run.append(name)
    if missing and not lacking:  # measure what exists instead: the backends the installed GRPOConfig has
        run += [f"grpo_ext/{value}" for value in others]
    return run, missing


def run_case(case: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """One contender on one case in a fresh process; the row (times, peak) or a row with the reason it is n/a."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")  # freed blocks leave RSS
    cmd = [sys.executable, __file__, "--child", json.dumps(case)]
    try:
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        return dict(note=f"over the {timeout_s:.0f} s limit per contender")
    lines = [line for line in result.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if result.returncode != 0 or not lines:
        tail = (result.stderr or result.stdout).strip().splitlines()[-1:] or ["no output"]
        return dict(note=f"failed (exit {result.returncode}): {tail[0][:200]}")
    return json.loads(lines[-1][len(RESULT_PREFIX) :])


def check_grad_norms(rows: list[dict[str, Any]], rtol: float = 1e-3) -> bool:
    """Prints, per case, how far the contenders' first-step gradient norms are apart; False when above ``rtol``.

    Every contender starts from the same parameters and trains on the same batch, so the norms of their first
    gradients must agree (up to float32 summation order): a check that each one computed the same step.
    """
    ok = True
    for case in dict.fromkeys(row["case"] for row in rows):
        norms = {row["impl"]: row["grad_norm"] for row in rows if row["case"] == case and "grad_norm" in row}
        if not norms:
            continue
        reference = statistics.median(norms.values())
        spread = max(abs(n - reference) for n in norms.values()) / max(abs(reference), 1e-12)
        ok = ok and spread <= rtol
        status = "ok" if spread <= rtol else "MISMATCH"
        print(f"check {case}: first-step gradient norms {', '.join(f'{k} {v:.6g}' for k, v in norms.items())}; "
              f"largest relative gap {spread:.1e} ({status}, tolerance {rtol:g})")  # fmt: skip
    return ok


def main() -> None:
    parser = cli.make_parser(__doc__)
    parser.add_argument("--vocabs", default=None, help="comma-separated V (default 32000,151936; quick: 512)")
    parser.add_argument("--lengths", default=None, help="comma-separated completion lengths T (default 256,1024)")
    parser.add_argument("--batch", type=int, default=None, help="completions per step (default 8; quick: 4)")
    parser.add_argument("--prompt-length", type=int, default=None, help="prompt tokens (default 32; quick: 4)")
    parser.add_argument("--hidden", type=int, default=None, help="hidden size (default 256; quick: 32)")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers")
    parser.add_argument("--heads", type=int, default=4, help="attention heads (Qwen2.5-0.5B: 14)")
    parser.add_argument("--kv-heads", type=int, default=2, help="key/value heads (Qwen2.5-0.5B: 2)")
    parser.add_argument("--intermediate", type=int, default=None,
                        help="MLP width (default 2 x hidden; Qwen2.5-0.5B: 4864)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per contender (default 3; quick: 1)")
    parser.add_argument("--contenders", default=",".join(CONTENDERS), help="comma-separated: " + ", ".join(CONTENDERS))
    parser.add_argument("--max-logits-gib", type=float, default=None,
                        help="skip a contender holding [B, P+T, V] float32 logits above this (default: none)")
    parser.add_argument("--no-generation", action="store_true", help="skip the gen+step figure (reported n/a)")
    parser.add_argument("--timeout-s", type=float, default=1800.0, help="limit per contender and case")
    parser.add_argument("--options", default=None,
                        help="KEY=VALUE,... loss options of every contender's config (e.g. entropy_coef=0.01)")
    parser.add_argument("--gradient-checkpointing", choices=("off", "on", "both"), default="off",
                        help="transformers' activation checkpointing for every contender (rows +ckpt); both: each "
                             "contender with and without (default off)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)  # JSON of one case: run it in this process
    args = parser.parse_args()
    if args.child is not None:
        print(RESULT_PREFIX + json.dumps(run_child(json.loads(args.child))), flush=True)
        return

    device = environment.resolve_device(args.device)
    env = environment.environment(device)
    print(f"device: {env['device_name']} | torch {env['torch_version']} | CUDA {env['cuda_version']}")
    quick = args.quick
    vocabs = [int(v) for v in cli.parse_list(args.vocabs or ("512" if quick else "32000,151936"))]
    lengths = [int(t) for t in cli.parse_list(args.lengths or ("16" if quick else "256,1024"))]
    shape = dict(
        batch=args.batch or (4 if quick else 8), prompt_length=args.prompt_length or (4 if quick else 32),
        hidden=args.hidden or (32 if quick else 256), layers=args.layers, heads=args.heads, kv_heads=args.kv_heads,
        intermediate=args.intermediate, steps=args.steps or (1 if quick else 3),
        seed=args.seed, device=str(device), generation=not args.no_generation, options=parse_options(args.options),
    )  # fmt: skip
    if shape["batch"] % NUM_GENERATIONS:
        raise SystemExit(f"--batch must be a multiple of num_generations={NUM_GENERATIONS}")
    settings_on = {"off": [False], "on": [True], "both": [False, True]}[args.gradient_checkpointing]
    requested = cli.parse_list(args.contenders)
    contenders, missing = [], {}
    for checkpointing in settings_on:
        run, lacking = select_contenders(requested, shape["options"], checkpointing)
        suffix = "+ckpt" if checkpointing else ""
        contenders += [(name + suffix, name, checkpointing) for name in run]
        missing.update({name + suffix: why for name, why in lacking.items()})
    for name, reason in missing.items():
        print(f"note: {name} not run: {reason}")

    rows: list[dict[str, Any]] = []
    for vocab in vocabs:
        for length in lengths:
            case_name = f"V={vocab} T={length} B={shape['batch']} P={shape['prompt_length']} H={shape['hidden']}"
            if shape["options"]:
                case_name += " " + " ".join(f"{key}={value}" for key, value in shape["options"].items())
            logits_gib = shape["batch"] * (shape["prompt_length"] + length) * vocab * 4 / 2**30
            for label, contender, checkpointing in contenders:
                full_logits = contender in ("grpo_ext/plain", "grpo_ext/torch", "grpo_ext/grpo_ext")
                row: dict[str, Any] = dict(case=case_name, impl=label, vocab=vocab, length=length)
                if full_logits and args.max_logits_gib is not None and logits_gib > args.max_logits_gib:
                    row["note"] = f"skipped: its logits take {logits_gib:.1f} GiB, over --max-logits-gib"
                else:
                    started = time.perf_counter()
                    child = dict(shape, vocab=vocab, length=length, contender=contender, checkpointing=checkpointing)
                    row.update(run_case(child, args.timeout_s))
                    print(f"{case_name} {label}: {time.perf_counter() - started:.0f} s", flush=True)
                rows.append(row)
            rows += [dict(case=case_name, impl=name, vocab=vocab, length=length, note=why)
                     for name, why in missing.items()]  # fmt: skip

    checked = check_grad_norms(rows)
    columns = [("case", "case", "s"), ("impl", "impl", "s"), ("step_ms", "step ms", "ms"),
               ("gen_step_ms", "gen+step ms", "ms"), ("peak_bytes", "peak MiB", "mib")]  # fmt: skip
    memory = "allocator peak" if device.type == "cuda" else "peak RSS"
    print()
    print(f"one training step (step: generation excluded; gen+step: included); peak MiB: {memory} above the model and "
          "optimizer state")  # fmt: skip
    print(reporting.format_table(rows, columns))
    for row in rows:
        if row.get("note"):
            print(f"n/a  {row['case']} {row['impl']}: {row['note']}")
    settings = {key: (str(value) if isinstance(value, Path) else value) for key, value in vars(args).items()}
    path = reporting.output_path(__file__, device, quick, args.out)
    payload = {"benchmark": "one GRPO training step", "environment": env, "settings": {**settings, **shape},
               "rows": rows}  # fmt: skip
    reporting.write_json(path, payload)
    print(f"wrote {path}")
    if not checked:
        raise SystemExit("the contenders disagree on the first step's gradient norm (above): a wrong step is not timed")


if __name__ == "__main__":
    main()
