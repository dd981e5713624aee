"""The drafter's training-time-test attention equals what chain decoding computes with a
KV cache, step by step: the TTT mask (prefix of target features + own chain) is the
decoding pattern, so training and serving see the same function."""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import LlamaConfig

from eagletrain.drafter import DraftKVCache, Eagle3Drafter, drafter_config
from eagletrain.train.ttt import shift


def tiny_llama_config(**overrides) -> LlamaConfig:
    """The tiny target shape the unit tests share (8 layers, so aux ids 1, 3, 4)."""
    fields = dict(
        vocab_size=50,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    return LlamaConfig(**{**fields, **overrides})


def tiny_drafter(seed: int = 0) -> tuple[Eagle3Drafter, torch.nn.Embedding]:
    target = tiny_llama_config()
    torch.manual_seed(seed)
    drafter = Eagle3Drafter(drafter_config(target, 20, [1, 3, 4])).double()
    drafter.set_draft_vocab(torch.arange(0, 40, 2))
    return drafter, torch.nn.Embedding(50, 32).double()


def test_ttt_steps_equal_cached_chain_decoding():
    drafter, embed = tiny_drafter()
    t, steps = 12, 4
    aux = torch.randn(1, t, 3 * 32, dtype=torch.float64)
    tokens = torch.randint(0, 50, (1, t))
    positions = torch.arange(t)[None]
    hidden, past, ttt_hidden = drafter.fc(aux), [], []
    for k in range(steps):
        hidden, kv = drafter.step_ttt(hidden, embed(shift(tokens, 1 + k)), positions + k, past)
        past.append(kv)
        ttt_hidden.append(hidden)

    for i in range(t - steps):
        cache = DraftKVCache()
        out = drafter.step_cached(
            drafter.fc(aux[:, : i + 1]), embed(tokens[:, 1 : i + 2]), positions[:, : i + 1], cache
        )[:, -1:]
        torch.testing.assert_close(out[0, 0], ttt_hidden[0][0, i])
        for k in range(1, steps):
            token = tokens[:, i + 1 + k : i + 2 + k]
            out = drafter.step_cached(out, embed(token), torch.tensor([[i + k]]), cache)
            torch.testing.assert_close(out[0, 0], ttt_hidden[k][0, i])


def test_draft_vocab_mapping_round_trips():
    drafter, _ = tiny_drafter()
    ids = torch.arange(0, 40, 2)
    assert torch.equal(drafter.target_ids(), ids)
    assert drafter.t2d.sum() == 20 and drafter.t2d[ids].all()
    assert torch.equal(drafter.d2t, ids - torch.arange(20))


def test_drafter_norms_run_in_float32_under_bf16_autocast_without_the_slow_path():
    drafter, embed = tiny_drafter()
    drafter.float()
    aux = torch.randn(1, 6, 3 * 32)
    tokens = embed.float()(torch.randint(0, 50, (1, 6)))
    reference = torch.nn.RMSNorm(32, eps=drafter.norm.eps)
    x = torch.randn(4, 32)
    torch.testing.assert_close(drafter.norm(x), reference(x), rtol=0, atol=0)
    with warnings.catch_warnings():
        # torch warns when a bf16 input meets a float32 norm weight (and skips its kernel)
        warnings.simplefilter("error")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            hidden, _ = drafter.step_ttt(drafter.fc(aux), tokens, torch.arange(6)[None], [])
            normed = drafter.norm(x.bfloat16())
    assert hidden.dtype == normed.dtype == torch.bfloat16
    torch.testing.assert_close(normed.float(), reference(x), rtol=0.02, atol=0.02)


def test_dense_ttt_attention_keeps_flex_out_of_the_forward(monkeypatch):
    """Held-out evaluation runs TTT attention dense (no flex kernel to compile), also
    where flex would be chosen, and the drafter goes back to flex afterwards."""
    import eagletrain.drafter as drafter_module

    drafter, embed = tiny_drafter()
    aux = torch.randn(1, 6, 3 * 32, dtype=torch.float64)
    tokens = torch.randint(0, 50, (1, 6))
    positions = torch.arange(6)[None]

    def flex_called():
        raise AssertionError("flex_attention used")

    drafter_module.set_ttt_attention(drafter, "flex")  # train.ttt_attention = "flex"
    monkeypatch.setattr(drafter_module, "_flex_attention", flex_called)
    with drafter_module.dense_ttt_attention(drafter):
        hidden, _ = drafter.step_ttt(drafter.fc(aux), embed(tokens), positions, [])
    assert hidden.shape == (1, 6, 32)
    with pytest.raises(AssertionError, match="flex_attention used"):
        drafter.step_ttt(drafter.fc(aux), embed(tokens), positions, [])
