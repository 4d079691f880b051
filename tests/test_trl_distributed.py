"""grpo_ext.integrations.trl on 2 CPU processes: TRL's fused path gives 1 process' losses and gradients, as TRL does.

One ``accelerate launch`` of 2 gloo ranks (tests/trl_distributed_child.py) runs every case: each rank takes half the
rows of one global batch, with TRL's ``num_items_in_batch`` (the global token count), and runs ``compute_loss`` and
backward through the wrapped model, with TRL's own code and then patched by grpo_ext (the fused path,
grpo_loss_from_hidden inside TRL's fused LM head). DDP averages the gradients with an all-reduce, FSDP2 with a
reduce-scatter (the child gathers the full gradients). The test process runs the same trainers on the whole batch in
one process. Then: grpo_ext on 2 ranks == TRL on 2 ranks, and both == 1 process (the mean of the ranks' losses, the
gradients, the metrics TRL reduces over processes).

How it launches: ``accelerate launch --cpu --num_processes 2`` starts one process only (accelerate's simple launcher
starts several CPU processes only through mpirun), so the launch uses the torchrun launcher (``--multi_gpu``); the
trainers' ``use_cpu=True`` makes accelerate set up its MULTI_CPU (gloo) state in each rank.

FSDP2: accelerate does not shard on CPU. With ``GRPOConfig(fsdp=True, fsdp_config={"fsdp_version": 2})`` the
trainer's accelerator stays MULTI_CPU and ``is_fsdp_enabled`` is False (``AcceleratorState`` switches to FSDP only
from the multi-accelerator types), and ``accelerate launch --use_fsdp --cpu`` is refused. The child shards the model
with accelerate's own ``fsdp2_prepare_model`` and the plugin built from that config, which is what
``Accelerator.prepare`` does on GPUs.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from grpo_ext.trainer.demo import build_tokenizer

# Skips (or, with GRPO_EXT_REQUIRE_TRL=1, fails) as the single-process tests do when trl is missing or unsupported;
# grpo_trl (grpo_ext.integrations.trl, which imports trl) comes from there, after that check.
from trl_utils import (
    T,
    assert_same,
    assert_same_entropy_control,
    entropy_control_state,
    grpo_trl,
    loss_and_grads,
    make_inputs,
    make_trainer,
    restore_entropy_control_state,
    save_model,
)

WORLD = 2
CHILD = Path(__file__).with_name("trl_distributed_child.py")
ENTROPY = dict(entropy_coef=0.05, use_adaptive_entropy=True, entropy_coef_delta=0.02)  # + entropy_target, per batch

# Each case: GRPOConfig overrides, trainer attributes set before each compute_loss, and how the 2 ranks are wrapped.
CASES: dict[str, dict[str, Any]] = {
    # token-level normalizer: num_items_in_batch / num_processes on each rank
    "dapo_ddp": dict(config=dict(loss_type="dapo", beta=0.04), backend="ddp"),
    # per-row mean, loss_scale 1 / gradient_accumulation_steps
    "grpo_ddp": dict(config=dict(loss_type="grpo", beta=0.04), backend="ddp"),
    "dapo_fsdp2": dict(config=dict(loss_type="dapo", beta=0.04), backend="fsdp2"),
    "grpo_fsdp2": dict(config=dict(loss_type="grpo", beta=0.04), backend="fsdp2"),
    # TRL's token masks, from a no-grad pass inside the forward (the entropy quantile is over every rank's tokens)
    "masks_dapo_ddp": dict(
        config=dict(loss_type="dapo", beta=0.04, top_entropy_quantile=0.5, off_policy_mask_threshold=0.02),
        backend="ddp",
    ),
    "masks_vespo_fsdp2": dict(
        config=dict(loss_type="vespo", top_entropy_quantile=0.5, off_policy_mask_threshold=0.02), backend="fsdp2"
    ),
    # TRL's adaptive entropy bonus: applied (the last step's entropy 0 is below the target), then the window's
    # entropy summed over the ranks moves the coefficient at this sync step.
    "entropy_dapo_ddp": dict(
        config=dict(loss_type="dapo", beta=0.04, **ENTROPY), backend="ddp", attrs=dict(_last_world_entropy=0.0)
    ),
    "entropy_grpo_fsdp2": dict(
        config=dict(loss_type="grpo", beta=0.04, **ENTROPY), backend="fsdp2", attrs=dict(_last_world_entropy=0.0)
    ),
    # tied embeddings: the embedding's gradient rows go into the LM head's gradient in place
    # (grpo_ext/ops/tied_embedding.py), before DDP's gradient hook (the all-reduce) fires, and before FSDP2's
    # reduce-scatter (accelerate wraps the embedding, final norm and LM head as one unit: FSDPEmbedding)
    "tied_dapo_ddp": dict(config=dict(loss_type="dapo", beta=0.04), backend="ddp", arch="qwen2_tied"),
    "tied_grpo_fsdp2": dict(config=dict(loss_type="grpo", beta=0.04), backend="fsdp2", arch="qwen2_tied"),
}
# TRL's entropy bonus is the mean entropy of each process' own tokens: with ranks holding different token counts the
# 2-process loss and gradients are not those of 1 process; they are compared with TRL's on 2 processes only.
PER_PROCESS_BONUS = ("entropy_dapo_ddp", "entropy_grpo_fsdp2")

# the tiny models gain nothing from threads; one keeps the tests cheap on shared cores (conftest.one_thread)
pytestmark = pytest.mark.usefixtures("one_thread")


def entropy_target(trainer, batch: dict[str, Any]) -> tuple[float, float, list[float]]:
    """An entropy target on one side of the mean entropy over both ranks, and between the ranks' own means.

    Returns:
        The target (halfway between the global mean and the rank's mean on the other side of it), the global mean
        of the completion tokens' entropy, and each rank's mean (rows split as the child splits them).
    """
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    with torch.no_grad():
        _, entropy, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, T, compute_entropy=True)
    completion = batch["completion_mask"].double()
    sums, counts = (entropy.double() * completion).view(WORLD, -1).sum(1), completion.view(WORLD, -1).sum(1)
    world, ranks = (sums.sum() / counts.sum()).item(), (sums / counts).tolist()
    # the global mean lies between the ranks' means: halfway to the farther one leaves the widest margin on both sides
    farther = max(ranks, key=lambda e: abs(e - world))
    return (world + farther) / 2, world, ranks


def single_process(trainer, batch: dict[str, Any], attrs: dict[str, Any]) -> dict[str, Any]:
    """TRL's compute_loss, then grpo_ext's, on the whole batch in this process (as the child does on each rank)."""
    initial = entropy_control_state(trainer)
    out = {}
    for impl in ("trl", "grpo_ext"):
        restore_entropy_control_state(trainer, initial)
        if impl == "grpo_ext":
            grpo_trl.patch(trainer)
        for name, value in attrs.items():
            setattr(trainer, name, value)
        out[impl] = (*loss_and_grads(trainer, batch), entropy_control_state(trainer))
    return out


def launch(spec: Path, out: Path, timeout: float = 300.0) -> None:
    """Runs the child on WORLD CPU ranks through ``accelerate launch``; stops the launcher past ``timeout`` seconds."""
    command = [
        sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", f"--num_processes={WORLD}",
        "--num_machines=1", "--mixed_precision=no", "--dynamo_backend=no", "--num_cpu_threads_per_process=1",
        "--main_process_port=0", str(CHILD), "--spec", str(spec), "--out", str(out),
    ]  # fmt: skip
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    log = out / "launch.log"  # a file, not a pipe: reading a pipe would wait for every rank holding it to exit
    with log.open("w") as sink:
        proc = subprocess.Popen(command, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.terminate()  # torchrun stops its ranks on SIGTERM (the ranks also exit when it is gone)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            pytest.fail(f"the 2-process run took over {timeout} s:\n{log.read_text()[-6000:]}")
    assert proc.returncode == 0, log.read_text()[-8000:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Any]:
    """The single-process results in this process, then the 2 ranks' (one launch for every case)."""
    tmp = tmp_path_factory.mktemp("trl_distributed")
    previous = torch.get_num_threads()
    torch.set_num_threads(1)  # module fixtures are set up before conftest.one_thread
    try:
        tokenizer = build_tokenizer()
        model_dir = save_model(tmp / "model", tokenizer)
        arch_dirs = {arch: save_model(tmp / arch, tokenizer, arch)
                     for arch in {case["arch"] for case in CASES.values() if "arch" in case}}  # fmt: skip
        cases = {name: dict(case, config=dict(case["config"]), attrs=case.get("attrs", {}))
                 for name, case in CASES.items()}  # fmt: skip
        base = make_trainer(model_dir, tokenizer, tmp / "base")
        batch = make_inputs(base)  # old and reference log-probs from the model; num_items_in_batch is global
        # The coefficient moves one way from the entropy over both ranks, and the other way on one rank from its own.
        target, world_entropy, rank_entropies = entropy_target(base, batch)
        for name in PER_PROCESS_BONUS:
            cases[name]["config"]["entropy_target"] = target

        spec = dict(model_dir=model_dir, batch=batch, cases={})
        single = {}
        for name, case in cases.items():
            case_dir = arch_dirs.get(case.get("arch"), model_dir)
            spec["cases"][name] = dict(config=case["config"], attrs=case["attrs"], backend=case["backend"],
                                       model_dir=case_dir)  # fmt: skip
            key = repr((case_dir, sorted(case["config"].items())))  # DDP and FSDP2 cases share a 1-process run
            if key not in single:
                trainer = make_trainer(case_dir, tokenizer, tmp / "single", **case["config"])
                single[key] = single_process(trainer, batch, case["attrs"])
            case["single"] = single[key]
    finally:
        torch.set_num_threads(previous)
    torch.save(spec, tmp / "spec.pt")
    launch(tmp / "spec.pt", tmp)
    ranks = [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
    return dict(cases=cases, ranks=ranks, target=target, world_entropy=world_entropy, rank_entropies=rank_entropies)


def ranks_mean(ranks: list[dict], name: str, impl: str) -> tuple[torch.Tensor, dict, dict]:
    """The 2-process run as one (loss, gradients, metrics): the ranks' mean loss (what TRL logs), rank 0's rest."""
    loss = torch.stack([r[name][impl]["loss"] for r in ranks]).mean()
    return loss, ranks[0][name][impl]["grads"], ranks[0][name][impl]["metrics"]


@pytest.mark.parametrize("name", list(CASES))
def test_two_processes_match_trl_and_one_process(runs, name):
    case, ranks = runs["cases"][name], runs["ranks"]
    setup = ranks[0][name]["setup"]
    assert setup["distributed_type"] == "DistributedType.MULTI_CPU" and setup["num_processes"] == WORLD
    if case["backend"] == "fsdp2":
        # really sharded: an FSDP module, and each rank holds half of the LM head's rows
        grads = ranks[0][name]["grpo_ext"]["grads"]  # a tied head's weight is named once, as the embedding's
        vocab, hidden = grads.get("lm_head.weight", grads.get("model.embed_tokens.weight")).shape
        assert setup["wrapper"].startswith("FSDP") and setup["lm_head_shard"] == ("DTensor", (vocab // WORLD, hidden))
    else:
        assert setup["wrapper"] == "DistributedDataParallel"

    for rank in ranks:
        # TRL's code never reached grpo_ext; the patched one took the fused path, once, and a tied model's lookup
        assert rank[name]["trl"]["fused_calls"] == 0 and rank[name]["grpo_ext"]["fused_calls"] == 1
        tied = case.get("arch") == "qwen2_tied"
        assert (rank[name]["trl"]["tied_lookups"], rank[name]["grpo_ext"]["tied_lookups"]) == (0, int(tied))
        for impl in ("trl", "grpo_ext"):
            # the replicas' gradients are the same reduced values, the metrics the same reduced numbers
            for param, grad in rank[name][impl]["grads"].items():
                assert torch.equal(grad, ranks[0][name][impl]["grads"][param]), (impl, param)
            assert rank[name][impl]["metrics"] == ranks[0][name][impl]["metrics"], impl
            coefs = [r[name][impl]["entropy_control"]["entropy_coef"] for r in (rank, ranks[0])]
            assert coefs[0] == coefs[1], impl
        # grpo_ext == TRL on each rank: its loss, the reduced gradients, the metrics, the entropy controller
        trl_run, ext_run = rank[name]["trl"], rank[name]["grpo_ext"]
        assert_same((trl_run["loss"], trl_run["grads"], trl_run["metrics"]),
                    (ext_run["loss"], ext_run["grads"], ext_run["metrics"]))  # fmt: skip
        assert_same_entropy_control(trl_run["entropy_control"], ext_run["entropy_control"], 1e-5)

    for impl in ("trl", "grpo_ext"):
        loss, grads, metrics, control = case["single"][impl]
        two = ranks_mean(ranks, name, impl)
        if name in PER_PROCESS_BONUS:
            # The controller sees the entropy over both ranks, as 1 process sees it: the same step, the same
            # coefficient; so do the metrics TRL reduces over processes.
            assert_same_entropy_control(control, ranks[0][name][impl]["entropy_control"], 1e-5)
            assert control["entropy_coef"] != pytest.approx(0.05)  # the controller moved
            assert two[2].keys() == metrics.keys()
            for key, value in metrics.items():
                assert two[2][key] == pytest.approx(value, rel=1e-5, abs=1e-5), key
        else:
            assert_same((loss, grads, metrics), two)
            if case["config"]["loss_type"] == "vespo":  # metrics worth comparing: vespo's weight, no clip share
                assert two[2]["vespo/phi_seq_mean"] != pytest.approx(1.0)
            else:
                assert two[2]["clip_ratio/region_mean"] > 0 and two[2]["kl"] > 0


def test_entropy_target_splits_the_ranks(runs):
    """The adaptive cases discriminate: one rank's own entropy would move the coefficient the other way."""
    target, world = runs["target"], runs["world_entropy"]
    low, high = sorted(runs["rank_entropies"])
    assert low < target < high
    # the controller's entropy over both ranks is the one computed here, far from the target (beyond float32 rounding)
    assert runs["cases"]["entropy_dapo_ddp"]["single"]["trl"][3]["last"] == pytest.approx(world, abs=1e-6)
    assert abs(world - target) > 2e-5
