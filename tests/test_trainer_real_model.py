"""A real checkpoint's way in: a GGUF file (weights and tokenizer), chat-formatted prompts, a real tokenizer's EOS
and a checkpoint's generation_config. Tiny models written here; no download."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from grpo_ext.trainer import cli
from grpo_ext.trainer.demo import build_model, build_tokenizer
from trainer_utils import small_config, without_timing

gguf = pytest.importorskip("gguf")

# A sentencepiece-style ("llama") vocabulary: <unk>, <s>, </s>, the word marker, characters and a few merges.
CHARS = list("abcdefghijklmnopqrstuvwxyz0123456789?:.>")
PIECES = ["▁", *CHARS, "▁h", "he", "ll", "lo", "▁w", "or"]
TOKENS = ["<unk>", "<s>", "</s>", *PIECES]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
HIDDEN, HEADS, KV_HEADS, LAYERS, FFN = 16, 2, 1, 2, 32


def llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=len(TOKENS), hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=64, rms_norm_eps=1e-5,
        rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k layout (convert_hf_to_gguf's LlamaModel.permute); transformers undoes it on load."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_llama_gguf(path, seed: int = 0) -> dict[str, torch.Tensor]:
    """A tiny LLaMA (GQA, untied head) and its tokenizer and chat template as a float32 GGUF file; returns the
    weights under transformers' names."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    reference = LlamaForCausalLM(llama_config())
    with torch.no_grad():
        for p in reference.parameters():  # norms away from 1, so a dropped or offset norm would show
            p.copy_(torch.randn_like(p) * 0.3 + (1.0 if p.ndim == 1 else 0.0))
    state = {k: v.detach().clone() for k, v in reference.state_dict().items()}

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(LAYERS)
    writer.add_context_length(64)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_rope_dimension_count(HIDDEN // HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(TOKENS))
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(TOKENS)
    # Scores rank the merges: longer pieces are preferred.
    writer.add_token_scores([0.0, 0.0, 0.0] + [-100.0 + len(p) for p in PIECES])
    writer.add_token_types([gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
                           + [gguf.TokenType.NORMAL] * len(PIECES))  # fmt: skip
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(True)
    writer.add_chat_template(CHAT_TEMPLATE)

    def tensor(name: str, key: str, permute_heads: int | None = None) -> None:
        w = state[key].numpy().astype(np.float32)
        writer.add_tensor(name, _permute(w, permute_heads) if permute_heads else w)

    tensor("token_embd.weight", "model.embed_tokens.weight")
    tensor("output_norm.weight", "model.norm.weight")
    tensor("output.weight", "lm_head.weight")
    for i in range(LAYERS):
        hf = f"model.layers.{i}."
        tensor(f"blk.{i}.attn_norm.weight", hf + "input_layernorm.weight")
        tensor(f"blk.{i}.attn_q.weight", hf + "self_attn.q_proj.weight", HEADS)
        tensor(f"blk.{i}.attn_k.weight", hf + "self_attn.k_proj.weight", KV_HEADS)
        tensor(f"blk.{i}.attn_v.weight", hf + "self_attn.v_proj.weight")
        tensor(f"blk.{i}.attn_output.weight", hf + "self_attn.o_proj.weight")
        tensor(f"blk.{i}.ffn_norm.weight", hf + "post_attention_layernorm.weight")
        tensor(f"blk.{i}.ffn_gate.weight", hf + "mlp.gate_proj.weight")
        tensor(f"blk.{i}.ffn_up.weight", hf + "mlp.up_proj.weight")
        tensor(f"blk.{i}.ffn_down.weight", hf + "mlp.down_proj.weight")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return state


@pytest.fixture(scope="module")
def gguf_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gguf")
    state = write_llama_gguf(folder / "tiny-llama.gguf")
    return folder, state


def test_a_gguf_file_loads_its_weights_and_tokenizer(gguf_folder):
    from transformers import LlamaForCausalLM

    folder, state = gguf_folder
    model, tokenizer = cli.load_model_and_tokenizer(str(folder), gguf_file="tiny-llama.gguf")
    assert isinstance(model, LlamaForCausalLM) and model.dtype == torch.float32
    assert model.config.num_key_value_heads == KV_HEADS and model.config.vocab_size == len(TOKENS)
    loaded = model.state_dict()
    for key, value in state.items():
        torch.testing.assert_close(loaded[key], value, rtol=0, atol=0, msg=key)

    reference = LlamaForCausalLM(llama_config())
    reference.load_state_dict(state)
    ids = torch.tensor([[1, 5, 9, 14, 20, 7, 3, 30]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, rtol=1e-5, atol=1e-5)

    # The tokenizer: the file's vocabulary, special tokens, BOS added to text, a lossless round trip.
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.eos_token_id) == ("<s>", "</s>", 2)
    assert tokenizer.pad_token_id == tokenizer.eos_token_id  # no pad token in the file: EOS pads
    ids = tokenizer("hello world 42?")["input_ids"]
    assert ids[0] == 1 and 0 not in ids  # BOS, and no <unk>
    assert tokenizer.decode(ids, skip_special_tokens=True) == "hello world 42?"
    assert tokenizer.chat_template == CHAT_TEMPLATE


def test_a_gguf_file_elsewhere_and_a_missing_one(gguf_folder, tmp_path):
    folder, _ = gguf_folder
    model, _ = cli.load_model_and_tokenizer(str(tmp_path), gguf_file=str(folder / "tiny-llama.gguf"))  # absolute
    assert model.config.hidden_size == HIDDEN
    with pytest.raises(ValueError, match=r"gguf_file: no GGUF file .*nope\.gguf"):
        cli.load_model_and_tokenizer(str(folder), gguf_file="nope.gguf")


def _chat_tokenizer():
    tokenizer = build_tokenizer()
    # The demo's characters only: the template writes BOS, the content and a ">" as the assistant's header.
    tokenizer.chat_template = (
        "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}>"
        "{% endif %}"
    )
    return tokenizer


class Recorder:
    """A reward function that keeps what it was given."""

    __name__ = "recorder"

    def __init__(self):
        self.prompts, self.completions = [], []

    def __call__(self, prompts, completions, **columns):
        self.prompts += list(prompts)
        self.completions += list(completions)
        return [float(len(str(c))) for c in completions]


def _trainer(tmp_path, rows, tokenizer, reward, **overrides):
    from grpo_ext.trainer.trainer import GRPOTrainer

    model = build_model(tokenizer, seed=0)
    config = small_config(tmp_path, **{"max_steps": 1, "per_device_train_batch_size": 8, **overrides})
    return GRPOTrainer(model, [reward], rows, config, tokenizer=tokenizer)


def test_message_prompts_go_through_the_chat_template(tmp_path):
    tokenizer = _chat_tokenizer()
    messages = [[{"role": "user", "content": d}] for d in ("123", "45")]
    reward = Recorder()
    trainer = _trainer(tmp_path, [{"prompt": m, "answer": "x"} for m in messages], tokenizer, reward)

    prompt_ids, prompt_mask, *_ = trainer.generate(messages, 1, greedy=True)
    for row, message in enumerate(messages):
        expected = tokenizer.apply_chat_template(message, add_generation_prompt=True, tokenize=True, return_dict=False)
        assert prompt_ids[row][prompt_mask[row].bool()].tolist() == expected
        assert expected[0] == tokenizer.bos_token_id and expected[-1] == tokenizer.convert_tokens_to_ids(">")
    assert prompt_mask[1, 0] == 0 and prompt_ids[1, 0] == tokenizer.pad_token_id  # left padding

    trainer.train()
    # As in TRL: the prompts as the dataset holds them, each completion as one assistant message.
    assert reward.prompts and all(p in messages for p in reward.prompts)
    for completion in reward.completions:
        assert isinstance(completion, list) and len(completion) == 1
        assert completion[0]["role"] == "assistant" and isinstance(completion[0]["content"], str)
        assert "<eos>" not in completion[0]["content"] and "<pad>" not in completion[0]["content"]


def test_string_prompts_stay_text_with_a_chat_template(tmp_path):
    tokenizer = _chat_tokenizer()
    prompts = ["123>", "45>"]
    reward = Recorder()
    trainer = _trainer(tmp_path, [{"prompt": p} for p in prompts], tokenizer, reward)
    prompt_ids, prompt_mask, *_ = trainer.generate(prompts, 1, greedy=True)
    for row, prompt in enumerate(prompts):  # no template, no BOS: this tokenizer adds no special tokens
        assert prompt_ids[row][prompt_mask[row].bool()].tolist() == tokenizer(prompt)["input_ids"]
    trainer.train()
    assert set(reward.prompts) <= set(prompts)
    assert reward.completions and all(isinstance(c, str) for c in reward.completions)


def test_builtin_rewards_take_message_completions():
    from grpo_ext.trainer.rewards import accuracy_reward, format_reward, graded_answer_reward

    text = "<think>\nx\n</think>\n<answer>\n42\n</answer>"
    as_messages = [[{"role": "assistant", "content": text}], [{"role": "assistant", "content": "7"}]]
    as_text = [text, "7"]
    for reward in (accuracy_reward, format_reward):
        answers = ["42", "7"]
        assert reward([None, None], as_messages, answer=answers) == reward([None, None], as_text, answer=answers)
    assert graded_answer_reward([None], [[{"role": "assistant", "content": "321"}]], answer=["321"]) == [1.2]


def test_stop_tokens_and_a_checkpoints_generation_config(tmp_path):
    """A completion stops at the model's generation_config EOS too (a chat model's end-of-turn token), and the
    checkpoint's sampling options (repetition penalty, no-repeat n-grams, top-k, min length) do not change what is
    sampled."""
    tokenizer = build_tokenizer()
    prompts = ["123>", "987>", "555>"]
    rows = [{"prompt": p} for p in prompts]
    config = dict(max_completion_length=8, num_generations=2, per_device_train_batch_size=6)
    plain = _trainer(tmp_path / "a", rows, tokenizer, Recorder(), **config)
    seeds = list(range(6))
    expected = plain.generate(prompts, 2, row_seeds=seeds)
    expected_greedy = plain.generate(prompts, 2, greedy=True)

    odd = _trainer(tmp_path / "b", rows, tokenizer, Recorder(), **config)
    odd.model.generation_config.update(repetition_penalty=3.0, no_repeat_ngram_size=1, top_k=2, min_new_tokens=6,
                                       temperature=0.3)  # fmt: skip
    for got, want in zip(odd.generate(prompts, 2, row_seeds=seeds), expected, strict=True):
        assert torch.equal(got, want)
    for got, want in zip(odd.generate(prompts, 2, greedy=True), expected_greedy, strict=True):
        assert torch.equal(got, want)

    # A second stop token: the first completion token of row 0 ends it.
    first = int(expected[2][0, 0])
    if first != tokenizer.eos_token_id:
        stopper = _trainer(tmp_path / "c", rows, tokenizer, Recorder(), **config)
        stopper.model.generation_config.eos_token_id = [tokenizer.eos_token_id, first]
        _, _, completion_ids, completion_mask, truncated = stopper.generate(prompts, 2, row_seeds=seeds)
        assert completion_mask[0].tolist() == [True] + [False] * (completion_mask.shape[1] - 1)
        assert not truncated[0]
        assert stopper.decode_completions(completion_ids[:1], completion_mask[:1]) == [
            tokenizer.decode([first], skip_special_tokens=True)
        ]


def test_cli_trains_a_gguf_model_on_message_prompts(gguf_folder, tmp_path, capsys):
    folder, _ = gguf_folder
    rows = [{"prompt": [{"role": "user", "content": f"what is {a}?"}], "answer": str(a)} for a in range(8)]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = {
        "model_name_or_path": str(folder), "gguf_file": "tiny-llama.gguf", "dataset": str(tmp_path / "data.jsonl"),
        "reward_funcs": ["accuracy"], "num_generations": 4, "per_device_train_batch_size": 8,
        "max_completion_length": 3, "max_steps": 1, "report_to": "none", "disable_tqdm": True, "plot": False,
        "output_dir": str(tmp_path / "out"), "save_steps": 1,
    }  # fmt: skip
    (tmp_path / "run.yaml").write_text("".join(f"{k}: {json.dumps(v)}\n" for k, v in run.items()))
    assert cli.main(["train", "--config", str(tmp_path / "run.yaml")]) == 0, capsys.readouterr().err
    assert (tmp_path / "out" / "metrics.jsonl").read_text().count("\n") == 1
    # A GGUF model's checkpoint is a plain float32 model folder (transformers refuses to save a "quantized" one).
    saved = tmp_path / "out" / "checkpoint-1"
    assert "quantization_config" not in json.loads((saved / "config.json").read_text())
    assert cli.load_model_and_tokenizer(saved)[0].dtype == torch.float32


def test_cli_trains_lora_with_a_held_out_set_and_a_reward_file(gguf_folder, tmp_path, capsys, monkeypatch):
    """The run keys of examples/smollm2_sums.yaml: ``eval_dataset``, ``lora`` and a ``file.py:function`` reward."""
    folder, _ = gguf_folder
    rows = [{"prompt": [{"role": "user", "content": f"what is {a}?"}], "answer": str(a)} for a in range(10)]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:8]))
    (tmp_path / "held_out.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[8:]))
    (tmp_path / "my_rewards.py").write_text(
        "def has_digit(prompts, completions, answer, **_):\n"
        "    return [float(any(ch.isdigit() for ch in c[-1]['content'])) for c in completions]\n"
    )
    monkeypatch.chdir(tmp_path)  # the reward file's path is relative to the working directory
    run = {
        "model_name_or_path": str(folder), "gguf_file": "tiny-llama.gguf", "dataset": "data.jsonl",
        "eval_dataset": "held_out.jsonl", "reward_funcs": "my_rewards.py:has_digit",
        "lora": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]},
        "num_generations": 4, "per_device_train_batch_size": 8, "max_completion_length": 3, "max_steps": 2,
        "save_steps": 2, "report_to": "none", "disable_tqdm": True, "plot": False, "output_dir": "out",
    }  # fmt: skip
    (tmp_path / "run.yaml").write_text("".join(f"{k}: {json.dumps(v)}\n" for k, v in run.items()))
    assert cli.main(["train", "--config", "run.yaml"]) == 0, capsys.readouterr().err
    logged = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == [0, 1, 2]
    assert [r["step"] for r in logged if "eval/rewards/has_digit/mean" in r] == [0, 2]
    assert "rewards/has_digit/mean" in logged[1]
    saved = tmp_path / "out" / "checkpoint-2"
    assert (saved / "adapter_config.json").is_file()  # a LoRA run saves its adapter
    assert json.loads((saved / "adapter_config.json").read_text())["r"] == 4
    final = tmp_path / "out" / "final_model"  # the run's end: the same adapter
    assert (final / "adapter_model.safetensors").read_bytes() == (saved / "adapter_model.safetensors").read_bytes()

    # The adapters' random init follows the run's seed: a second run repeats the first, whatever the global RNG
    # held before (model loading and other libraries draw from it).
    torch.manual_seed(12345)
    assert cli.main(["train", "--config", "run.yaml", "--output_dir", "again"]) == 0, capsys.readouterr().err
    again = [json.loads(line) for line in (tmp_path / "again" / "metrics.jsonl").read_text().splitlines()]
    assert [without_timing(r) for r in again] == [without_timing(r) for r in logged]


def test_the_readmes_way_to_load_a_lora_runs_final_model(gguf_folder, tmp_path):
    """README "Training a real model": the GGUF base model, then ``peft.PeftModel.from_pretrained`` of the run's
    ``final_model``, gives the trained model's logits and greedy answer."""
    from peft import LoraConfig, PeftModel, get_peft_model

    from grpo_ext.trainer.trainer import GRPOTrainer

    folder, _ = gguf_folder
    base, tokenizer = cli.load_model_and_tokenizer(str(folder), gguf_file="tiny-llama.gguf")
    torch.manual_seed(0)
    lora = LoraConfig(task_type="CAUSAL_LM", r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    model = get_peft_model(base, lora)
    with torch.no_grad():  # B away from peft's zero init: the adapter changes the logits before and after training
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.1)
    rows = [{"prompt": [{"role": "user", "content": f"what is {a}?"}]} for a in range(8)]
    config = small_config(tmp_path, max_steps=2, per_device_train_batch_size=8, learning_rate=1e-2)
    def length(prompts, completions, **_):
        return [float(len(c[-1]["content"])) for c in completions]

    trainer = GRPOTrainer(model, [length], rows, config, tokenizer=tokenizer)
    trainer.train()
    trainer.model.eval()

    # The README's lines, on the tiny GGUF file.
    base, tokenizer = cli.load_model_and_tokenizer(str(folder), gguf_file="tiny-llama.gguf")
    loaded = PeftModel.from_pretrained(base, tmp_path / "run" / "final_model").eval()
    messages = [{"role": "user", "content": "what is 42?"}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    output = loaded.generate(**inputs, max_new_tokens=6, do_sample=False)
    answer = tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)

    with torch.no_grad():
        assert torch.equal(loaded(**inputs).logits, trainer.model(**inputs).logits)
        with loaded.disable_adapter():  # the adapter matters: the base alone gives other logits
            assert not torch.allclose(loaded(**inputs).logits, trainer.model(**inputs).logits)
    expected = trainer.model.generate(**inputs, max_new_tokens=6, do_sample=False)
    assert torch.equal(output, expected)
    assert answer == tokenizer.decode(expected[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
