"""The graphed regeneration decoder (static_batch_decoder.py) against transformers'
generate on a tiny random-weight Llama: the same tokens, the same ends, compiled or not."""

from __future__ import annotations

import pytest
import torch
from conftest import build_tiny_target

from eagletrain.config import RegenerateConfig
from eagletrain.data.local_generator import LocalGenerator
from eagletrain.decode.batch_decoder import StaticBatchDecoder
from eagletrain.target import TargetSource, load_target, load_tokenizer

CHATS = [[{"role": "user", "content": "w " * n}] for n in (1, 9, 4, 20, 33)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    source = TargetSource(build_tiny_target(tmp_path_factory.mktemp("t"), layers=2), "tiny")
    return load_tokenizer(source), load_target(source, "float32", "cpu")


def encoded(tokenizer, chats) -> list[list[int]]:
    texts = [
        tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in chats
    ]
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


def test_graphed_regeneration_equals_generate_with_rows_ending_early(tiny, monkeypatch):
    tokenizer, model = tiny
    plain = LocalGenerator(model, tokenizer, RegenerateConfig(max_tokens=24, batch_size=8))
    first = plain.generate(CHATS)
    # a token some replies emit part-way and others never becomes the end of sequence:
    # rows then end apart, some at it, some at max_tokens
    stop = next(t for t in first[1].token_ids[2:] if any(t not in c.token_ids for c in first))
    monkeypatch.setattr(model.generation_config, "eos_token_id", stop)
    cfg = RegenerateConfig(max_tokens=24, batch_size=8)
    expected = LocalGenerator(model, tokenizer, cfg).generate(CHATS)
    graphed_cfg = cfg.model_copy(update={"decoder": "graphed"})
    graphed = LocalGenerator(model, tokenizer, graphed_cfg, max_prompt_tokens=128)
    got = graphed.generate(CHATS)
    assert {c.finish_reason for c in expected} == {"stop", "length"}
    assert [(c.token_ids, c.finish_reason, c.completion_tokens, c.text) for c in got] == [
        (c.token_ids, c.finish_reason, c.completion_tokens, c.text) for c in expected
    ]
    # the cache is reused: another batch, fewer rows, another order
    again = graphed.generate(CHATS[::-1][:3])
    assert [c.token_ids for c in again] == [c.token_ids for c in expected[::-1][:3]]


def test_compiled_decoding_step_gives_the_eager_tokens(tiny):
    tokenizer, model = tiny
    prompts = encoded(tokenizer, CHATS)
    eos = {tokenizer.eos_token_id}
    pad = tokenizer.pad_token_id or tokenizer.eos_token_id
    eager = StaticBatchDecoder(model, rows=6, width=160, compile=False)
    compiled = StaticBatchDecoder(model, rows=6, width=160, compile=True)
    expected = eager.generate(prompts, 16, eos, pad)
    assert compiled.generate(prompts, 16, eos, pad) == expected
    assert compiled.generate(prompts[:2], 16, eos, pad) == expected[:2]


def test_sampled_first_tokens_follow_the_tempered_softmax(tiny):
    """At temperature 0.5, 4,096 rows of one prompt draw their first token from
    softmax(logits / 0.5): the empirical distribution is within 0.15 of it in total
    variation (the greedy token alone would be ~0.9 away)."""
    tokenizer, model = tiny
    prompt = encoded(tokenizer, CHATS[:1])[0]
    with torch.inference_mode():
        probs = (model(torch.tensor([prompt])).logits[0, -1] / 0.5).softmax(-1).double()
    rows = 4096
    decoder = StaticBatchDecoder(model, rows=rows, width=64, temperature=0.5)
    torch.manual_seed(0)
    first = torch.tensor([t[0] for t in decoder.generate([prompt] * rows, 1, set(), 0)])
    empirical = torch.bincount(first, minlength=probs.numel()).double() / rows
    assert 0.5 * (empirical - probs).abs().sum() < 0.15
    assert 1 - probs.max() > 0.5  # so a sampler stuck on the greedy token would fail


def test_a_batch_longer_than_the_cache_is_refused(tiny):
    _, model = tiny
    decoder = StaticBatchDecoder(model, rows=2, width=40)
    with pytest.raises(ValueError, match="exceed the cache"):
        decoder.generate([list(range(30))], 16, set(), 0)
    with pytest.raises(ValueError, match="3 prompts for a decoder of 2 rows"):
        decoder.generate([[1], [2], [3]], 4, set(), 0)


def test_graphed_decoder_needs_the_prompt_bound(tiny):
    tokenizer, model = tiny
    with pytest.raises(ValueError, match="max_prompt_tokens"):
        LocalGenerator(model, tokenizer, RegenerateConfig(decoder="graphed"))
