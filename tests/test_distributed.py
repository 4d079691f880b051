"""GRPOTrainer on torch.distributed (gloo on CPU): 2 ranks give the updates of 1 rank over the same global batch.

One spawn of 2 processes runs every case (process start-up dominates the cost); the 1-rank runs happen in the test
process itself, with no process group, so they are also the plain single-process trainer.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from grpo_ext.trainer import GRPOConfig
from grpo_ext.trainer.checkpoint import check_resume_batch
from grpo_ext.trainer.demo import build_model, build_tokenizer, reversal_dataset, reversal_reward
from grpo_ext.trainer.metrics import TIMING_METRICS
from grpo_ext.trainer.sampling import RowSeededSampler
from grpo_ext.trainer.trainer import GRPOTrainer
from trainer_utils import AttentionCalls, gloo_rank

WORLD = 2
GLOBAL_BATCH = 16

# Each case: GRPOConfig overrides of both runs, plus micro_rows, the rows of a global micro-batch (default
# GLOBAL_BATCH / gradient_accumulation_steps): per_device_train_batch_size is micro_rows / world size.
CASES = {
    "grpo": dict(loss_type="grpo", eval_steps=2),
    "grpo_batch_std": dict(loss_type="grpo", scale_rewards="batch"),
    # beta != 0: reference model and zero-std masking (the token count excludes masked rows); num_iterations=2
    # queues a micro-batch, which checkpoint-1 holds.
    "dapo_kl": dict(loss_type="dapo", beta=0.04, num_iterations=2, save_steps=1),
    # 2 rows per rank and micro-batch with G=4: every group is split over the two ranks.
    "dr_grpo_split_groups": dict(
        loss_type="dr_grpo", gradient_accumulation_steps=2, steps_per_generation=4, micro_rows=4
    ),
    "bnpo_accumulated": dict(loss_type="bnpo", gradient_accumulation_steps=2),
    "grpo_dynamic_sampling": dict(loss_type="grpo", dynamic_sampling=True, max_sampling_rounds=3),
    # FSDP2 on CPU: the 2-rank run shards, the 1-rank run is the plain trainer. The loss and log-probs from hidden
    # states (logps_backend="fused", the default) run inside the root's forward, where the LM head is unsharded.
    "grpo_fsdp": dict(loss_type="grpo", fsdp=True, num_iterations=2, save_steps=1, eval_steps=2),
    # ... with the sharded reference model's log-probs too (fused, chunked)
    "dapo_kl_fsdp": dict(loss_type="dapo", fsdp=True, beta=0.04, num_iterations=2),
}
FSDP_CASES = ("grpo_fsdp", "dapo_kl_fsdp")
# Cases with a held-out set of 7 rows (4 + 3 over the ranks: the short rank repeats a row), evaluated at steps 0, 2, 3.
EVAL_CASES = ("grpo", "grpo_fsdp")
EVAL_ROWS = 7
# Cases whose 2-rank run also resumes from its checkpoint-1 on 2 ranks (must end bit-identical).
RESUMED = ("dapo_kl", "grpo_fsdp")
# Gradient checkpointing on and off, one step each in float64, under each layout (fused path, beta > 0).
CHECKPOINTING_LAYOUTS = {"ddp": dict(fsdp=False), "fsdp": dict(fsdp=True)}


def case_config(output_dir: Path, case: str, world_size: int, **extra) -> GRPOConfig:
    # adam_epsilon: AdamW's update lr * g / (|g| + eps) amplifies a gradient element's float32 rounding near 0 by up to
    # lr / eps; with the default 1e-8 that is 3e5, and two correct runs that differ only in the order of their sums
    # (all-reduce vs one batch) end 4e-6 apart. With 1e-3 they agree to the last bits, so the comparison can be tight.
    options = dict(
        output_dir=str(output_dir), seed=5, max_steps=3, num_generations=4, max_completion_length=4,
        max_prompt_length=None, learning_rate=3e-3, adam_epsilon=1e-3, lr_scheduler_type="constant",
        report_to="none", disable_tqdm=True, log_completions=False, plot=False,
    )  # fmt: skip
    options.update(CASES[case])
    options.update(extra)
    micro_rows = options.pop("micro_rows", GLOBAL_BATCH // options.get("gradient_accumulation_steps", 1))
    options.setdefault("per_device_train_batch_size", micro_rows // world_size)
    if world_size == 1:
        options["fsdp"] = False
    return GRPOConfig(**options)


def make_trainer(config: GRPOConfig, case: str | None = None) -> GRPOTrainer:
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, seed=0)
    train_rows, held_out = reversal_dataset(seed=0)
    eval_rows = held_out[:EVAL_ROWS] if case in EVAL_CASES else None
    return GRPOTrainer(model, [reversal_reward], train_rows, config, tokenizer=tokenizer, eval_dataset=eval_rows)


def full_params(trainer: GRPOTrainer) -> dict[str, torch.Tensor]:
    """Parameters as plain CPU tensors (FSDP's DTensor shards gathered: a collective)."""
    out = {}
    for name, value in trainer.model.state_dict().items():
        if hasattr(value, "full_tensor"):
            value = value.full_tensor()
        out[name] = value.detach().cpu().clone()
    return out


def tied_model(tokenizer) -> torch.nn.Module:
    """The demo model with its LM head tied to the input embedding (as Qwen2.5-0.5B's): the trainer's tied lookup
    (grpo_ext/ops/tied_embedding.py) adds the embedding's gradient rows into the head's in place."""
    model = build_model(tokenizer, seed=0).double()
    model.config.tie_word_embeddings = True
    model.lm_head.weight = model.model.embed_tokens.weight
    return model


def float64_step(output_dir: Path, gradient_checkpointing: bool, world_size: int = WORLD, tied: bool = False,
                 **options) -> dict:  # fmt: skip
    """One optimizer step of the demo model in float64 (case "dapo_kl"), with or without gradient checkpointing (and
    tied embeddings): the parameters before and after, the gradient norm, and each layer's attention calls in the
    step (2: recomputed)."""
    config = case_config(output_dir, "dapo_kl", world_size, gradient_checkpointing=gradient_checkpointing,
                         warmup_steps=0, save_steps=0, **options)  # fmt: skip
    tokenizer = build_tokenizer()
    train_rows, _ = reversal_dataset(seed=0)
    model = tied_model(tokenizer) if tied else build_model(tokenizer, seed=0).double()
    trainer = GRPOTrainer(model, [reversal_reward], train_rows, config, tokenizer=tokenizer)
    initial = full_params(trainer)
    trainer._generate_and_score()
    calls = AttentionCalls(trainer.model)
    metrics = trainer._training_step()
    calls.remove()
    return {"initial": initial, "params": full_params(trainer), "grad_norm": metrics["grad_norm"],
            "calls": calls.counts, "fused": trainer.policy_fused}  # fmt: skip


def _worker(rank: int, store: str, out_dir: str) -> None:
    """One rank of the 2-process run: every case, then the resumed runs; results saved per rank."""
    with gloo_rank(rank, store, WORLD):
        results = {}
        for case in CASES:
            run_dir = Path(out_dir) / case
            trainer = make_trainer(case_config(run_dir, case, WORLD), case)
            history = trainer.train()
            results[case] = {"params": full_params(trainer), "history": history,
                             "fused": (trainer.policy_fused, trainer.ref_fused)}  # fmt: skip
            if case in RESUMED:
                resumed = make_trainer(case_config(run_dir, case, WORLD, save_steps=0))
                resumed.train(resume_from_checkpoint=str(run_dir / "checkpoint-1"))
                results[case]["resumed_params"] = full_params(resumed)
        results["checkpointing"] = {
            layout: {on: float64_step(Path(out_dir) / f"ckpt_{layout}_{on}", on, **options) for on in (False, True)}
            for layout, options in CHECKPOINTING_LAYOUTS.items()
        }
        results["tied"] = {layout: float64_step(Path(out_dir) / f"tied_{layout}", True, tied=True, **options)
                           for layout, options in CHECKPOINTING_LAYOUTS.items()}  # fmt: skip
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")


# the tiny models gain nothing from threads; one keeps the tests cheap on shared cores (conftest.one_thread)
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp")
    mp.spawn(_worker, args=(str(out / "store"), str(out)), nprocs=WORLD, join=True)
    ranks = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
    return out, ranks


def without_timing(row: dict) -> dict:
    return {k: v for k, v in row.items() if k not in TIMING_METRICS}


def assert_same_params(actual: dict, expected: dict, exact: bool = False) -> None:
    assert actual.keys() == expected.keys()
    for name, value in actual.items():
        if exact:
            assert torch.equal(value, expected[name]), name
        else:
            torch.testing.assert_close(value, expected[name], rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("case", list(CASES))
def test_two_ranks_match_one_rank(two_rank_runs, tmp_path, case):
    out, ranks = two_rank_runs
    single = make_trainer(case_config(tmp_path / "single", case, 1), case)
    single_history = single.train()
    expected = full_params(single)
    initial = full_params(make_trainer(case_config(tmp_path / "init", case, 1)))
    assert any(not torch.equal(expected[k], initial[k]) for k in expected)  # training moved the weights

    # The ranks hold the same replica, and it is the 1-rank result up to float32 reduction order.
    assert_same_params(ranks[1][case]["params"], ranks[0][case]["params"], exact=True)
    assert_same_params(ranks[0][case]["params"], expected)

    # The same rollouts (rewards, lengths are per-row facts), the same global metrics up to rounding.
    two = ranks[0][case]["history"]
    steps = [0, 1, 2, 3] if case in EVAL_CASES else [1, 2, 3]
    assert [r["step"] for r in two] == steps
    for got, want in zip(two, single_history, strict=True):
        got, want = without_timing(got), without_timing(want)
        assert got.keys() == want.keys()
        for key in ("reward", "reward_std", "frac_reward_zero_std", "completions/mean_length", "num_tokens",
                    "eval/reward", "eval/completions/mean_length"):  # fmt: skip
            assert got.get(key) == want.get(key), key
        for key, value in want.items():
            assert got[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
    # Every rank returns the global metrics (only the clock-based ones are its own).
    assert [without_timing(r) for r in ranks[1][case]["history"]] == [without_timing(r) for r in two]

    # Rank 0 alone wrote the metrics: one line per step.
    rows = [json.loads(line) for line in (out / case / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == steps


@pytest.mark.parametrize("case", FSDP_CASES)
def test_fsdp_fused_matches_one_rank_plain(two_rank_runs, tmp_path, case):
    """FSDP2 on the fused path (the LM head whole inside the root's forward) equals one process on the plain path
    (the model's logits, selective_log_softmax, grpo_loss)."""
    _, ranks = two_rank_runs
    assert ranks[0][case]["fused"] == (True, "beta" in CASES[case])
    plain = make_trainer(case_config(tmp_path, case, 1, logps_backend="plain"))
    assert not plain.policy_fused
    plain.train()
    assert_same_params(ranks[0][case]["params"], full_params(plain))


@pytest.mark.parametrize("layout", CHECKPOINTING_LAYOUTS)
def test_gradient_checkpointing_gives_the_same_step_under_ddp_and_fsdp(two_rank_runs, layout):
    """2 ranks (float64, fused path, beta > 0): one optimizer step with gradient checkpointing (enabled before DDP or
    FSDP2 wraps the model) updates the parameters as the step without it, to 1e-12, on both ranks; each layer's
    attention runs twice in the step (the recompute inside FSDP2's gathered block), once without."""
    _, ranks = two_rank_runs
    for rank in ranks:
        runs = rank["checkpointing"][layout]
        assert runs[True]["fused"] and runs[False]["fused"]
        assert runs[True]["calls"] == [2, 2] and runs[False]["calls"] == [1, 1]
        assert runs[True]["grad_norm"] == pytest.approx(runs[False]["grad_norm"], rel=1e-12)
        off, on = runs[False]["params"], runs[True]["params"]
        assert max((off[name] - value).abs().max().item() for name, value in runs[False]["initial"].items()) > 1e-4
        for name, value in on.items():
            torch.testing.assert_close(value, off[name], rtol=0, atol=1e-12, msg=name)
    replicas = [rank["checkpointing"][layout][True]["params"] for rank in ranks]
    assert_same_params(replicas[1], replicas[0], exact=True)  # one replica (FSDP2: one sharded model)


@pytest.mark.parametrize("layout", CHECKPOINTING_LAYOUTS)
def test_tied_embeddings_step_under_ddp_and_fsdp_as_one_plain_process(two_rank_runs, tmp_path, layout):
    """A tied LM head (float64, fused path, checkpointing): the 2-rank step, whose embedding gradient rows go into
    the head's gradient in place before the weight's gradient hooks (DDP's all-reduce, FSDP2's reduce-scatter) fire,
    updates the parameters as one process on the plain path (the model's own logits and embedding), to 1e-12."""
    _, ranks = two_rank_runs
    plain = float64_step(tmp_path / "plain", True, world_size=1, tied=True, logps_backend="plain")
    assert not plain["fused"]
    for rank in ranks:
        run = rank["tied"][layout]
        assert run["fused"]
        assert run["grad_norm"] == pytest.approx(plain["grad_norm"], rel=1e-10)
        for name, value in plain["params"].items():
            torch.testing.assert_close(run["params"][name], value, rtol=0, atol=1e-12, msg=name)


@pytest.mark.parametrize("case", RESUMED)
def test_checkpoint_resumes_on_the_same_and_on_another_world_size(two_rank_runs, tmp_path, case):
    out, ranks = two_rank_runs
    run_dir = out / case
    # Written once, by rank 0, and no temporary folders left. The resumed run (from checkpoint-1, saving none) set the
    # first run's later checkpoints and its final model aside, whole.
    assert sorted(p.name for p in run_dir.iterdir() if "checkpoint" in p.name) == ["checkpoint-1"]
    aside = run_dir / "abandoned-after-step-1"
    assert sorted(p.name for p in aside.iterdir()) == ["checkpoint-2", "checkpoint-3", "final_model", "metrics.jsonl"]
    state = torch.load(run_dir / "checkpoint-1" / "trainer_state.pt", weights_only=False)
    assert state["world_size"] == WORLD and [len(q) for q in state["micro_batches_by_rank"]] == [1, 1]
    config = json.loads((run_dir / "checkpoint-1" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]  # not FSDP's generated subclass

    # 2 ranks -> 2 ranks: bit for bit.
    assert_same_params(ranks[0][case]["resumed_params"], ranks[0][case]["params"], exact=True)
    # 2 ranks -> 1 rank (the queued micro-batch re-cut): the uninterrupted 2-rank result up to rounding.
    copy = tmp_path / "copy"
    shutil.copytree(run_dir / "checkpoint-1", copy / "checkpoint-1")
    resumed = make_trainer(case_config(copy, case, 1, save_steps=0))
    resumed.train(resume_from_checkpoint=True)
    assert resumed.global_step == 3
    assert_same_params(full_params(resumed), ranks[0][case]["params"])


def test_resume_with_another_global_batch_fails_naming_the_option(two_rank_runs, tmp_path):
    out, _ = two_rank_runs
    trainer = make_trainer(case_config(tmp_path, "dapo_kl", 1, per_device_train_batch_size=8))
    with pytest.raises(ValueError, match=r"GRPOConfig\.per_device_train_batch_size must be 16 .* got 8"):
        trainer.load_checkpoint(out / "dapo_kl" / "checkpoint-1")
    with pytest.raises(ValueError, match=r"world_size=3 .* 16\) is not divisible by 3"):
        check_resume_batch(16, 3, trainer.config)


def test_fsdp_needs_a_process_group(tmp_path):
    with pytest.raises(ValueError, match=r"GRPOConfig\.fsdp=True needs torch\.distributed"):
        make_trainer(case_config(tmp_path, "grpo", 2, fsdp=True))
    with pytest.raises(ValueError, match=r"GRPOConfig\.fsdp must be a boolean"):
        GRPOConfig(fsdp="yes")


# ---------------------------------------------------------------------------------------------------------------
# per-row sampling
# ---------------------------------------------------------------------------------------------------------------


def test_a_rows_completion_does_not_depend_on_its_batch(tmp_path):
    trainer = make_trainer(case_config(tmp_path, "grpo", 1))
    prompts = ["123>", "45>", "6>", "789>"]
    seeds = [11, 22, 33, 44]
    _, _, together, together_mask, _ = trainer.generate(prompts, 1, row_seeds=seeds)
    for i in (3, 1):
        _, _, alone, alone_mask, _ = trainer.generate([prompts[i]], 1, row_seeds=[seeds[i]])
        n = int(alone_mask.sum())
        assert int(together_mask[i].sum()) == n
        assert torch.equal(together[i, :n], alone[0, :n])
    _, _, other, other_mask, _ = trainer.generate(prompts, 1, row_seeds=[s + 1 for s in seeds])
    assert not torch.equal(other * other_mask, together * together_mask)  # the seed matters
    with pytest.raises(ValueError, match="row_seeds has 3 seeds for 4 rows"):
        trainer.generate(prompts, 1, row_seeds=seeds[:3])


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"), [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.0, 3, 1.0), (1.0, 0, 0.8)]
)
def test_row_seeded_sampler_draws_the_warped_softmax(temperature, top_k, top_p):
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    expected = torch.softmax(logits / temperature, dim=0)
    if top_k:
        expected[expected.argsort(descending=True)[top_k:]] = 0
    if top_p < 1:
        order = expected.argsort(descending=True)
        before = expected[order].cumsum(0) - expected[order]  # mass of the tokens ranked above
        expected[order[before >= top_p]] = 0
    expected /= expected.sum()
    draws = 200_000
    uniforms = 1.0 - torch.rand(draws, 1, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    sampler = RowSeededSampler(uniforms, prompt_width=3, temperature=temperature, top_k=top_k, top_p=top_p)
    out = sampler(torch.zeros(draws, 3, dtype=torch.long), logits.expand(draws, -1).clone())
    assert ((out == 0).sum(dim=1) == 1).all() and (out.isneginf().sum(dim=1) == 5).all()
    freq = torch.bincount(out.argmax(dim=1), minlength=6).double() / draws
    assert (freq[expected == 0] == 0).all()
    torch.testing.assert_close(freq, expected.double(), atol=4e-3, rtol=0)


# ---------------------------------------------------------------------------------------------------------------
# the README's command: torchrun on the CLI
# ---------------------------------------------------------------------------------------------------------------


def test_torchrun_cli_matches_one_process(tmp_path):
    tokenizer = build_tokenizer()
    build_model(tokenizer).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    train_rows, _ = reversal_dataset(seed=0)
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in train_rows[:64]))
    (tmp_path / "run.yaml").write_text(
        f"model_name_or_path: {tmp_path / 'model'}\ndataset: {tmp_path / 'data.jsonl'}\nreward_funcs: [graded_answer]\n"
        "num_generations: 4\nmax_completion_length: 4\nmax_steps: 2\nlearning_rate: 0.001\nreport_to: none\n"
        "disable_tqdm: true\nplot: false\nlog_completions: false\nsave_steps: 2\n"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    runs = {"two": (2, 4), "one": (1, 8)}  # (processes, per-process batch): the same global batch of 8
    for name, (procs, per_device) in runs.items():
        command = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={procs}",
            "-m", "grpo_ext.trainer.cli", "train", "--config", str(tmp_path / "run.yaml"),
            "--output_dir", str(tmp_path / name), "--per_device_train_batch_size", str(per_device),
        ]  # fmt: skip
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
    metrics = {
        name: [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        for name in runs
    }
    assert [r["step"] for r in metrics["two"]] == [1, 2]
    for two, one in zip(metrics["two"], metrics["one"], strict=True):
        assert two["reward"] == one["reward"] and two["num_tokens"] == one["num_tokens"]
        assert two["loss"] == pytest.approx(one["loss"], abs=1e-6)
    assert (tmp_path / "two" / "checkpoint-2" / "model.safetensors").is_file()
