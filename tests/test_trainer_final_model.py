"""The model a run ends with: ``output_dir/final_model`` holds the trained weights and the tokenizer after every
finished run (a ``max_time_s`` stop included), under DDP and FSDP2 too, and replacing it never loses the earlier one.

LoRA runs (the adapter alone): tests/test_trainer_peft.py; a GGUF base model from the CLI and the README's loading
snippet: tests/test_trainer_real_model.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpo_ext.trainer.cli import main as cli_main
from grpo_ext.trainer.demo import build_model, build_tokenizer, reversal_dataset, reversal_reward
from grpo_ext.trainer.final_model import FinalModelWriteError
from grpo_ext.trainer.run_folder import OutputFolderError, prepare_output_dir
from grpo_ext.trainer.trainer import GRPOTrainer
from trainer_utils import Killed, gloo_rank, kill_after_rename_to, make_trainer, small_config, write_cli_inputs

# the tiny models gain nothing from threads; one keeps the tests cheap on shared cores (conftest.one_thread)
pytestmark = pytest.mark.usefixtures("one_thread")


def cpu_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer as a plain CPU tensor (FSDP2's shards gathered: a collective)."""
    out = {}
    for name, value in model.state_dict().items():
        if hasattr(value, "full_tensor"):
            value = value.full_tensor()
        out[name] = value.detach().cpu().clone()
    return out


def assert_loads_as(folder: Path, expected: dict[str, torch.Tensor]) -> None:
    """``from_pretrained(folder)`` gives exactly ``expected``'s tensors, no more and no fewer."""
    loaded = AutoModelForCausalLM.from_pretrained(folder).state_dict()
    assert loaded.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(loaded[name], value), name


def test_a_run_leaves_the_trained_model_and_its_tokenizer(tmp_path, capsys):
    trainer = make_trainer(small_config(tmp_path, max_steps=3))
    initial = cpu_state(build_model(build_tokenizer(), seed=0))
    trainer.train()
    final = tmp_path / "run" / "final_model"
    assert trainer.final_model_path == final
    assert capsys.readouterr().out.splitlines()[-1] == f"final model (step 3): {final}"

    trained = cpu_state(trainer.model)
    assert any(not torch.equal(trained[name], value) for name, value in initial.items())  # it did train
    assert_loads_as(final, trained)
    tokenizer = AutoTokenizer.from_pretrained(final)
    assert tokenizer.get_vocab() == trainer.tokenizer.get_vocab()
    assert (tokenizer.pad_token, tokenizer.eos_token, tokenizer.padding_side) == ("<pad>", "<eos>", "left")
    assert tokenizer("123>")["input_ids"] == trainer.tokenizer("123>")["input_ids"]
    assert json.loads((final / "config.grpo.json").read_text()) == trainer.config.to_dict()
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["final_model", "metrics.jsonl"]  # no leftovers


def test_a_time_stop_leaves_the_final_model_and_a_checkpoint_to_resume_from(tmp_path):
    trainer = make_trainer(small_config(tmp_path, max_steps=50, max_time_s=1e-6))
    trainer.train()
    assert trainer.global_step == 1
    assert_loads_as(tmp_path / "run" / "final_model", cpu_state(trainer.model))
    assert trainer.latest_checkpoint() == tmp_path / "run" / "checkpoint-1"  # save_steps is 0: for the time stop
    # A resumed run with more time and fewer steps (both may change on resume) continues from step 1.
    resumed = make_trainer(small_config(tmp_path, max_steps=3, max_time_s=3600.0))
    assert [row["step"] for row in resumed.train(resume_from_checkpoint=True)] == [2, 3]
    assert_loads_as(tmp_path / "run" / "final_model", cpu_state(resumed.model))
    assert resumed.latest_checkpoint() == tmp_path / "run" / "checkpoint-1"  # it reached max_steps: no new one


def test_replacing_the_final_model_never_loses_the_earlier_one(tmp_path, monkeypatch):
    """A resumed run replaces the final model. A failed save (a full disk) keeps the earlier one in place; a save
    killed between its two renames leaves the earlier one as final_model.previous, which the next run restores."""
    out, final = tmp_path / "run", tmp_path / "run" / "final_model"
    first = make_trainer(small_config(tmp_path, max_steps=2, save_steps=2))
    first.train()
    step_2 = cpu_state(first.model)

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    resumed = make_trainer(small_config(tmp_path, max_steps=4))
    monkeypatch.setattr(resumed.tokenizer, "save_pretrained", disk_full)  # after the model's files are written
    message = rf"could not write the final model to {final}: OSError: .*No space left on device.*final model are intact"
    with pytest.raises(FinalModelWriteError, match=message):
        resumed.train(resume_from_checkpoint=True)
    assert_loads_as(final, step_2)
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-2", "final_model", "metrics.jsonl"]
    monkeypatch.undo()
    step_4 = cpu_state(resumed.model)
    assert any(not torch.equal(step_4[name], value) for name, value in step_2.items())
    assert resumed.save_final_model() == final
    assert_loads_as(final, step_4)

    # Killed right after the earlier final model was moved aside: it is complete, and the next run puts it back.
    kill_after_rename_to(monkeypatch, "final_model.previous")
    with pytest.raises(Killed):
        resumed.save_final_model()
    monkeypatch.undo()
    assert not final.exists()
    assert_loads_as(out / "final_model.previous", step_4)
    with pytest.raises(OutputFolderError, match=r"run \(checkpoint-2, final_model, metrics\.jsonl\)"):
        prepare_output_dir(out, resume=False, overwrite=False)  # a fresh run puts it back first, then sees it
    assert_loads_as(final, step_4)
    prepare_output_dir(out, resume=True, overwrite=False).release()  # what a resumed run does first
    assert_loads_as(final, step_4)
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-2", "final_model", "metrics.jsonl"]

    # Killed after both renames: the new one is in place; the earlier one is deleted when the next run starts.
    shutil.copytree(final, out / "final_model.previous")
    prepare_output_dir(out, resume=True, overwrite=False).release()
    assert not (out / "final_model.previous").exists()
    assert_loads_as(final, step_4)


def test_cli_names_the_final_model_last(tmp_path, capsys):
    run_file = write_cli_inputs(tmp_path, max_steps=2)
    capsys.readouterr()
    assert cli_main(["train", "--config", str(run_file)]) == 0
    lines = capsys.readouterr().out.splitlines()
    final = tmp_path / "out" / "final_model"
    assert lines[-4:] == [f"final model (step 2): {final}", f"metrics: {tmp_path / 'out' / 'metrics.jsonl'}",
                          "curves: (plot off)", f"model: {final}"]  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(final)
    assert model.config.architectures == ["LlamaForCausalLM"]
    assert AutoTokenizer.from_pretrained(final).get_vocab() == build_tokenizer().get_vocab()


# ---------------------------------------------------------------------------------------------------------------
# 2 processes (gloo): rank 0 writes the full model, gathered from the FSDP2 shards
# ---------------------------------------------------------------------------------------------------------------

WORLD = 2
DISTRIBUTED_CASES = {"ddp": dict(fsdp=False), "fsdp": dict(fsdp=True), "fsdp_lora": dict(fsdp=True, lora=True)}


def _distributed_trainer(out_dir: Path, fsdp: bool, lora: bool = False) -> GRPOTrainer:
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, seed=0, hidden_size=32, num_layers=1, num_heads=2)
    if lora:
        import peft

        torch.manual_seed(1)
        config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
        model = peft.get_peft_model(model, config)
    rows, _ = reversal_dataset(seed=0)
    config = small_config(out_dir, max_steps=2, per_device_train_batch_size=8, fsdp=fsdp)
    return GRPOTrainer(model, [reversal_reward], rows, config, tokenizer=tokenizer)


def _worker(rank: int, store: str, out_dir: str) -> None:
    with gloo_rank(rank, store, WORLD):
        results = {}
        for case, options in DISTRIBUTED_CASES.items():
            trainer = _distributed_trainer(Path(out_dir) / case, **options)
            trainer.train()
            results[case] = cpu_state(trainer.model)
            del trainer  # its wrappers hold the process group (gloo_rank collects them before destroying it)
        if rank == 0:
            torch.save(results, Path(out_dir) / "trained.pt")


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("final_model_ddp")
    mp.spawn(_worker, args=(str(out / "store"), str(out)), nprocs=WORLD, join=True)
    return out, torch.load(out / "trained.pt", weights_only=False)


@pytest.mark.parametrize("case", ["ddp", "fsdp"])
def test_two_ranks_leave_one_full_model(two_rank_runs, case):
    out, trained = two_rank_runs
    final = out / case / "run" / "final_model"
    assert sorted(p.name for p in final.parent.iterdir()) == ["final_model", "metrics.jsonl"]  # no temp folders
    assert_loads_as(final, trained[case])  # the full tensors, not rank 0's shards
    assert json.loads((final / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]  # not FSDP's


def test_two_ranks_fsdp_lora_leave_the_adapter(two_rank_runs):
    import peft
    from safetensors.torch import load_file

    out, trained = two_rank_runs
    final = out / "fsdp_lora" / "run" / "final_model"
    saved = load_file(final / "adapter_model.safetensors")
    assert saved and all("lora_" in name for name in saved)  # the adapter alone
    assert not (final / "model.safetensors").exists()
    tokenizer = build_tokenizer()
    base = build_model(tokenizer, seed=0, hidden_size=32, num_layers=1, num_heads=2)
    loaded = cpu_state(peft.PeftModel.from_pretrained(base, final))
    assert loaded.keys() == trained["fsdp_lora"].keys()
    for name, value in trained["fsdp_lora"].items():
        assert torch.equal(loaded[name], value), name
