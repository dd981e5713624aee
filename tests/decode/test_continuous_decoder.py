"""The refilling decoder (decode/continuous.py) against transformers' generate on a tiny
random-weight Llama: the same greedy tokens and ends for every request, with more requests
than rows (rows refilled as they finish), budgets that differ, compiled or not; sampling
follows the target's distribution."""

from __future__ import annotations

import pytest
import torch
from conftest import build_tiny_target
from transformers import LlamaForCausalLM

from eagletrain.decode.continuous import ContinuousDecoder, Request, take_from
from eagletrain.errors import ConfigError
from eagletrain.target import TargetSource, load_target, load_tokenizer


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    source = TargetSource(build_tiny_target(tmp_path_factory.mktemp("t"), layers=2), "tiny")
    return load_tokenizer(source), load_target(source, "float32", "cpu")


def generate_greedy(model, prompt: list[int], max_new: int, eos: set[int]) -> list[int]:
    """transformers' generate, one prompt at a time (no padding): the reference."""
    stops = {"eos_token_id": sorted(eos)} if eos else {"min_new_tokens": max_new}
    out = model.generate(
        input_ids=torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=max_new,
        do_sample=False,
        pad_token_id=0,
        **stops,
    )[0, len(prompt) :].tolist()
    end = next((i for i, t in enumerate(out) if t in eos), None)
    return out if end is None else out[: end + 1]


def requests(n: int, seed: int = 0) -> list[Request]:
    rng = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = int(torch.randint(2, 30, (1,), generator=rng))
        prompt = torch.randint(3, 300, (length,), generator=rng).tolist()
        out.append(Request(i, prompt, int(torch.randint(4, 20, (1,), generator=rng))))
    return out


def test_packed_refills_across_attention_blocks_give_generates_tokens(tiny):
    """Prompts of 60-200 tokens packed end to end into refills of up to 1,024 positions:
    prompts start and end inside flex's 128-token blocks, and a block's queries reach back
    into the blocks where their prompt began."""
    _, model = tiny
    rng = torch.Generator().manual_seed(3)
    work = [
        Request(i, torch.randint(3, 300, (int(torch.randint(60, 200, (1,), generator=rng)),),
                                 generator=rng).tolist(), 6)
        for i in range(14)
    ]  # fmt: skip
    expected = {r.id: generate_greedy(model, r.prompt, r.max_new, set()) for r in work}
    decoder = ContinuousDecoder(model, rows=8, width=256, max_new=6, eos=set(),
                                packed_prefill=True, prefill_positions=1024)  # fmt: skip
    got = {f.request.id: f.tokens for f in decoder.run(take_from(work))}
    assert got == expected
    assert decoder.prefilled_positions == decoder.prompt_tokens > 1024


@pytest.mark.parametrize(
    ("compile", "attention", "packed"),
    [(False, "sdpa", False), (True, "sdpa", False), (False, "flex", False), (False, "sdpa", True)],
)
def test_refilled_rows_give_generates_tokens(tiny, compile, attention, packed):
    """Compiled, the step and (dynamic shapes) the refills' prefill both are; packed, a
    refill's prompts go end to end through one forward."""
    _, model = tiny
    work = requests(13)
    # a token that some replies emit part-way becomes the end of sequence, so rows end at
    # it and at their budgets, at different steps
    probe = [generate_greedy(model, r.prompt, r.max_new, set()) for r in work]
    eos = {next(t for t in probe[2][1:] if any(t not in p for p in probe))}
    expected = {r.id: generate_greedy(model, r.prompt, r.max_new, eos) for r in work}
    decoder = ContinuousDecoder(model, rows=4, width=64, max_new=24, eos=eos, compile=compile,
                                attention=attention, check_every=3,
                                packed_prefill=packed)  # fmt: skip
    assert decoder.prefill_compiled == compile
    decoder.warm_up()
    got = {f.request.id: (f.tokens, f.stopped) for f in decoder.run(take_from(work))}
    assert {i: tokens for i, (tokens, _) in got.items()} == expected
    assert {stopped for _, stopped in got.values()} == {True, False}
    # 13 requests on 4 rows: every step had a row busy, and the tail left some empty
    stats = decoder.stats()
    assert stats["steps"] == decoder.steps_run > 0 and 0.25 <= stats["rows_busy"] < 1
    if packed:  # no padded position was computed
        assert decoder.prefilled_positions == decoder.prompt_tokens
    assert all(stopped == (tokens[-1] in eos) for tokens, stopped in got.values())
    # the cache is reused by another run, with other requests
    again = {f.request.id: f.tokens for f in decoder.run(take_from(work[::-1][:5]))}
    assert again == {r.id: expected[r.id] for r in work[::-1][:5]}


def test_a_refill_is_prefilled_by_length_in_bounded_forwards(tiny):
    """Prompts of one refill, sorted by length into forwards of at most `prefill_positions`
    padded positions, pad less than one forward padded to the longest, with the same tokens."""
    _, model = tiny
    work = requests(16, seed=3)
    expected = {r.id: generate_greedy(model, r.prompt, r.max_new, set()) for r in work}

    def decoded(budget: int) -> tuple[dict, ContinuousDecoder]:
        decoder = ContinuousDecoder(
            model, rows=16, width=64, max_new=24, eos=set(), prefill_positions=budget
        )
        return {f.request.id: f.tokens for f in decoder.run(take_from(work))}, decoder

    whole, one_forward = decoded(1 << 20)
    grouped, bounded = decoded(64)
    assert whole == grouped == expected
    real = sum(len(r.prompt) for r in work)
    assert one_forward.prompt_tokens == bounded.prompt_tokens == real
    assert one_forward.prefilled_positions == 16 * max(len(r.prompt) for r in work)
    assert real <= bounded.prefilled_positions < 0.8 * one_forward.prefilled_positions


def test_refills_wait_for_refill_at_free_rows(tiny):
    """With `refill_at`, a refill waits until that many rows are free (or no row is busy):
    fewer refills, each larger, the same tokens; the device time splits into prefill and
    steps, within the run's own time."""
    import time

    _, model = tiny
    work = requests(30, seed=5)
    expected = {r.id: generate_greedy(model, r.prompt, r.max_new, set()) for r in work}

    def decoded(refill_at: int) -> tuple[dict, list, dict, float]:
        decoder = ContinuousDecoder(model, rows=8, width=64, max_new=24, eos=set(),
                                    check_every=2, refill_at=refill_at)  # fmt: skip
        source, asked = take_from(work), []

        def take(n: int, wait: bool):
            asked.append((n, wait))
            return source(n, wait)

        start = time.perf_counter()
        got = {f.request.id: f.tokens for f in decoder.run(take)}
        return got, asked, decoder.stats(), time.perf_counter() - start

    each, asked_each, stats_each, _ = decoded(1)
    grouped, asked_grouped, stats_grouped, seconds = decoded(5)
    assert each == grouped == expected
    assert all(n >= 5 or wait for n, wait in asked_grouped)
    assert any(n < 5 for n, _ in asked_each)  # without it, smaller refills happen
    assert stats_grouped["refills"] < stats_each["refills"]
    assert stats_grouped["rows_busy"] < stats_each["rows_busy"]  # rows waited for refills
    assert stats_grouped["prefill_forwards"] >= stats_grouped["refills"] > 0
    assert stats_grouped["prefill_s"] > 0 and stats_grouped["steps_s"] > 0
    # each figure is rounded to 0.01 s
    assert stats_grouped["prefill_s"] + stats_grouped["steps_s"] <= seconds + 0.01
    with pytest.raises(ConfigError, match="refill_at 9 must be between 1 and the 8 rows"):
        ContinuousDecoder(model, rows=8, width=64, max_new=4, eos=set(), refill_at=9)


def test_attention_width_follows_the_live_rows(tiny):
    """Rows attend only up to the widest live row's length (in buckets), not the whole cache."""
    _, model = tiny
    short = [Request(i, [5 + i, 6, 7], 8) for i in range(4)]
    decoder = ContinuousDecoder(model, rows=4, width=1024, max_new=8, eos=set())
    list(decoder.run(take_from(short)))
    assert decoder.attended_columns == decoder.steps_run * 4 * 128  # one bucket, not 1024


def test_a_request_beyond_the_cache_is_refused(tiny):
    _, model = tiny
    decoder = ContinuousDecoder(model, rows=2, width=128, max_new=16, eos=set())
    with pytest.raises(ValueError, match="exceed the decoder's 128 positions"):
        list(decoder.run(take_from([Request("long", list(range(3, 123)), 16)])))


def test_sampling_follows_the_targets_distribution():
    """Gumbel-max at T = 1: the first sampled token's frequencies are as close to
    softmax(logits) as draws from softmax(logits) itself are; the argmax is not."""
    from test_drafter import tiny_llama_config
    from test_speculative import null_threshold

    torch.manual_seed(4)
    model = LlamaForCausalLM(tiny_llama_config(tie_word_embeddings=False)).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
        exact = torch.softmax(model(torch.tensor([[5, 9, 2]])).logits[0, -1].double(), -1)
    decoder = ContinuousDecoder(model, rows=50, width=128, max_new=1, eos=set(), temperature=1.0)
    torch.manual_seed(0)
    seen = [f.tokens[0] for f in decoder.run(take_from([Request(i, [5, 9, 2], 1)
                                                        for i in range(2000)]))]  # fmt: skip
    freq = torch.bincount(torch.tensor(seen), minlength=50).double() / len(seen)
    threshold = null_threshold(exact, len(seen), torch.Generator().manual_seed(1))
    assert 0.5 * (freq - exact).abs().sum() <= threshold
    greedy = torch.zeros(50, dtype=torch.float64)
    greedy[exact.argmax()] = 1.0
    assert 0.5 * (greedy - exact).abs().sum() > threshold  # the test can fail


def test_top_p_samples_only_the_nucleus():
    from test_drafter import tiny_llama_config

    torch.manual_seed(4)
    model = LlamaForCausalLM(tiny_llama_config(tie_word_embeddings=False)).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
        probs = torch.softmax(model(torch.tensor([[5, 9, 2]])).logits[0, -1].double(), -1)
    ordered = probs.sort(descending=True)
    # the smallest set of most likely tokens whose mass reaches 0.6
    size = int((ordered.values.cumsum(0) < 0.6).sum()) + 1
    nucleus = set(ordered.indices[:size].tolist())
    decoder = ContinuousDecoder(
        model, rows=50, width=128, max_new=1, eos=set(), temperature=1.0, top_p=0.6
    )
    seen = {f.tokens[0] for f in decoder.run(take_from([Request(i, [5, 9, 2], 1)
                                                        for i in range(500)]))}  # fmt: skip
    assert seen == nucleus and 1 < len(nucleus) < 50


@pytest.mark.parametrize("packed", [False, True])
def test_regeneration_through_the_continuous_decoder_equals_generate(tiny, packed):
    """LocalGenerator with decoder "continuous": conversations ask concurrently, rows are
    refilled as replies end, and every completion equals generate's."""
    import asyncio

    from eagletrain.config import RegenerateConfig
    from eagletrain.data.local_generator import LocalGenerator

    tokenizer, model = tiny
    chats = [[{"role": "user", "content": "w " * n}] for n in (1, 9, 4, 20, 33, 2, 7)]
    cfg = RegenerateConfig(max_tokens=20, batch_size=3)
    expected = LocalGenerator(model, tokenizer, cfg).generate(chats)
    continuous = cfg.model_copy(update={"decoder": "continuous", "packed_prefill": packed})

    async def ask_all():
        async with LocalGenerator(model, tokenizer, continuous, max_prompt_tokens=200) as gen:
            return await asyncio.gather(*(gen.complete(c) for c in chats))

    got = asyncio.run(ask_all())
    assert [(c.token_ids, c.finish_reason, c.text) for c in got] == [
        (c.token_ids, c.finish_reason, c.text) for c in expected
    ]


def test_a_failed_conversation_stops_the_decoding_thread_at_once(tiny):
    """Leaving the generator on an error (a second SIGINT is one) drops the rows in flight
    and ends the decoding thread before returning, instead of decoding them to their
    budgets in a thread the exiting process would abort."""
    import asyncio

    from eagletrain.config import RegenerateConfig
    from eagletrain.data.local_generator import LocalGenerator

    tokenizer, model = tiny
    budget = 3000
    cfg = RegenerateConfig(max_tokens=budget, batch_size=3, decoder="continuous")
    generator = LocalGenerator(model, tokenizer, cfg, max_prompt_tokens=64)

    async def fail_mid_decoding():
        async with generator as gen:
            asks = [gen.complete([{"role": "user", "content": "w " * n}]) for n in (1, 5, 9)]
            pending = [asyncio.ensure_future(ask) for ask in asks]
            while gen._continuous.steps_run < 16:
                await asyncio.sleep(0.01)
            raise RuntimeError(f"a conversation failed ({len(pending)} in flight)")

    with pytest.raises(RuntimeError):
        asyncio.run(fail_mid_decoding())
    assert not generator._regen_thread.is_alive()
    assert generator._continuous.steps_run < budget
