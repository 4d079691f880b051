"""The trainer's tied input embedding (grpo_ext/ops/tied_embedding.py): with the LM head's weight shared, the
fused training forward gives the same gradients as the model's own lookup (float64), its backward allocates one
``[V, H]`` gradient instead of two, and the lookup falls back to the dense gradient where the head's never arrives."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from grpo_ext.ops import tied_embedding
from grpo_ext.trainer import policy_logps

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
VOCAB, HIDDEN, PAD = 3000, 48, 3


def tiny_qwen2(tied: bool = True) -> torch.nn.Module:
    config = transformers.Qwen2Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=96, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                                      tie_word_embeddings=tied, pad_token_id=PAD)  # fmt: skip
    torch.manual_seed(0)
    return transformers.Qwen2ForCausalLM(config).double()


def micro_batch(seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    batch, prompt, length = 4, 5, 8
    prompt_ids = torch.randint(0, VOCAB, (batch, prompt), generator=g)
    prompt_ids[0, :2] = PAD  # left padding: the padding row of the embedding gets no gradient
    prompt_mask = (prompt_ids != PAD).long()
    completion_mask = torch.ones(batch, length)
    completion_mask[1, 5:] = 0
    return dict(prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_mask=completion_mask,
                completion_ids=torch.randint(0, VOCAB, (batch, length), generator=g),
                advantages=torch.randn(batch, generator=g, dtype=torch.float64))  # fmt: skip


def loss_and_grads(model: torch.nn.Module, share: bool, monkeypatch, batches: int = 1):
    """The fused policy loss's gradients after ``batches`` micro-batches (accumulated in ``.grad``), with the tied
    lookup (share) or the model's own, and the trace of the first backward's allocations."""
    import memory_sites  # benchmarks/ (the test's monkeypatch.syspath_prepend)

    original = policy_logps._completion_head

    def completion_head(*args, share_tied_gradient=False):
        return original(*args, share_tied_gradient=share)

    monkeypatch.setattr(policy_logps, "_completion_head", completion_head)
    trace = None
    for index in range(batches):
        out = policy_logps.fused_policy_loss(model, model, micro_batch(seed=index + 1), 0.9, loss_type="dapo")
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True,
                                    with_stack=True) as profiler:  # fmt: skip
            out.loss.backward()
        trace = trace or memory_sites.profiler_trace(profiler)
    monkeypatch.setattr(policy_logps, "_completion_head", original)
    return {name: p.grad.clone() for name, p in model.named_parameters()}, trace


@pytest.mark.parametrize("batches", [1, 2])
def test_tied_lookup_gives_the_model_s_gradients_with_one_weight_gradient(monkeypatch, batches):
    """Every parameter's gradient as with the model's own embedding (float64, two micro-batches accumulated too;
    padded prompt positions, whose embedding row gets no gradient from the lookup); and no [V, H] buffer made by the
    embedding's backward (the model's own makes one), so the backward's peak is lower by one weight gradient."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import memory_sites

    shared, shared_trace = loss_and_grads(tiny_qwen2(), True, monkeypatch, batches)
    own, own_trace = loss_and_grads(tiny_qwen2(), False, monkeypatch, batches)
    assert shared.keys() == own.keys()
    for name in own:
        torch.testing.assert_close(shared[name], own[name], rtol=1e-12, atol=1e-14, msg=name)
    weight_bytes = VOCAB * HIDDEN * 8

    def embedding_buffers(trace):
        return [e for e in trace if e["action"] == "alloc" and e["size"] >= weight_bytes
                and any("EmbeddingBackward0" in f["name"] for f in e["frames"])]  # fmt: skip

    assert len(embedding_buffers(own_trace)) == 1 and not embedding_buffers(shared_trace)
    peak = {name: memory_sites.peak_sites({"device_traces": [t]})["peak_bytes"]
            for name, t in (("shared", shared_trace), ("own", own_trace))}  # fmt: skip
    lookup_rows_bytes = 4 * 13 * HIDDEN * 8  # B x (prompt + completion) rows: the lookup's few [N, H] temporaries
    assert peak["own"] - peak["shared"] >= weight_bytes - 4 * lookup_rows_bytes, peak


def test_tied_lookup_is_deterministic(monkeypatch):
    """Two runs of the same micro-batch give bit-identical gradients (the rows added in a fixed order)."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    runs = [loss_and_grads(tiny_qwen2(), True, monkeypatch)[0] for _ in range(2)]
    assert all(torch.equal(runs[0][name], runs[1][name]) for name in runs[0])


def test_tied_lookup_falls_back_to_the_dense_gradient():
    """No head gradient handed over (the alias never used): the lookup's backward returns nn.Embedding's gradient,
    the padding row's 0."""
    model = tiny_qwen2()
    embedding = model.get_input_embeddings()
    ids = torch.tensor([[PAD, 5, 7, 5], [1, 2, PAD, 2999]])
    upstream = torch.randn(2, 4, HIDDEN, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    inputs_embeds, sink = tied_embedding.tied_lookup(embedding, ids)
    (inputs_embeds * upstream).sum().backward()
    assert sink == []
    got = embedding.weight.grad.clone()
    embedding.weight.grad = None
    (embedding(ids) * upstream).sum().backward()
    torch.testing.assert_close(got, embedding.weight.grad, rtol=0, atol=1e-15)
    assert torch.count_nonzero(got[PAD]) == 0 and torch.count_nonzero(got[5]) == HIDDEN


def test_only_a_trained_plain_tied_embedding_is_shared():
    tied, untied = tiny_qwen2(), tiny_qwen2(tied=False)
    head = tied.get_output_embeddings().weight
    assert tied_embedding.tied_embedding(tied.model, head) is tied.model.embed_tokens
    assert tied_embedding.tied_embedding(untied.model, untied.get_output_embeddings().weight) is None
    assert tied_embedding.tied_embedding(tied.model, head.detach()) is None  # an effective (LoRA) weight
    head.requires_grad_(False)
    assert tied_embedding.tied_embedding(tied.model, head) is None  # frozen
    head.requires_grad_(True)
    tied.model.embed_tokens.forward = tied.model.embed_tokens.forward  # as accelerate's device hooks replace it
    assert tied_embedding.tied_embedding(tied.model, head) is None
    del tied.model.embed_tokens.forward
    # a wrapper class that keeps nn.Embedding's forward (FSDP2's FSDPEmbedding) is a plain lookup; one with a forward
    # of its own (Gemma's scaled lookup) is not
    class WrappedEmbedding(torch.nn.Embedding):
        pass

    class ScaledEmbedding(torch.nn.Embedding):
        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return 2.0 * super().forward(ids)

    embedding = tied.model.embed_tokens
    embedding.__class__ = WrappedEmbedding  # as fully_shard swaps it
    assert tied_embedding.tied_embedding(tied.model, head) is embedding
    embedding.__class__ = ScaledEmbedding
    assert tied_embedding.tied_embedding(tied.model, head) is None


def test_the_embedding_s_hooks_run_around_the_shared_lookup():
    """The lookup replaces the module's forward only: a forward hook (NEFTune's noise, say) still acts on its output,
    and the module's own forward is back afterwards."""
    model = tiny_qwen2()
    embedding = model.get_input_embeddings()
    handle = embedding.register_forward_hook(lambda module, args, output: output + 1.0)
    ids = torch.tensor([[1, 2, 3]])
    with tied_embedding.sharing_tied_gradient(model.model, model.get_output_embeddings().weight) as lookups:
        shared = embedding(ids)
    sinks = lookups.sinks
    assert len(sinks) == 1 and "forward" not in embedding.__dict__
    torch.testing.assert_close(shared, embedding(ids), rtol=0, atol=0)
    torch.testing.assert_close(shared, embedding.weight[ids] + 1.0, rtol=0, atol=0)
    handle.remove()
