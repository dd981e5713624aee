"""Greedy speculative decoding is lossless: its output equals plain greedy decoding token
for token, whatever the proposer drafts (EAGLE drafter, prompt lookup, or an oracle that
is right or wrong on purpose); tau is defined once, including the bonus token."""

from __future__ import annotations

import random

import pytest
import torch
from test_drafter import tiny_llama_config
from transformers import LlamaForCausalLM

from eagletrain.decode.acceptance import per_position_acceptance, pooled_tau
from eagletrain.decode.chain import plain_decode, speculative_chain
from eagletrain.decode.engine import DecodingEngine
from eagletrain.decode.proposers import EagleProposer, PromptLookupProposer
from eagletrain.drafter import Eagle3Drafter, drafter_config


@pytest.fixture(scope="module")
def target() -> LlamaForCausalLM:
    config = tiny_llama_config(max_position_embeddings=256, tie_word_embeddings=False)
    torch.manual_seed(3)
    return LlamaForCausalLM(config).double().eval()


class OracleProposer:
    """Drafts the true greedy continuation, corrupting draft j of a cycle with a set
    probability, so both acceptance and rejection paths run."""

    aux_layer_ids = None

    def __init__(self, truth: list[int], error_rate: float, seed: int):
        self.truth, self.error_rate, self.rng = truth, error_rate, random.Random(seed)

    def start(self, prompt, first, features):
        self.done = 1

    def propose(self, k):
        drafts = list(self.truth[self.done : self.done + k])
        drafts += [0] * (k - len(drafts))
        return [(t + 1) % 50 if self.rng.random() < self.error_rate else t for t in drafts]

    def advance(self, new_tokens, features):
        self.done += len(new_tokens)


def prompts(n: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(50) for _ in range(rng.randint(3, 20))] for _ in range(n)]


@pytest.mark.parametrize("k", [1, 3, 5])
def test_oracle_drafts_accept_and_reject_yet_output_is_identical(target, k):
    accepted_all = []
    for i, prompt in enumerate(prompts(12)):
        plain = plain_decode(DecodingEngine(target), prompt, 40, eos=set())
        spec = speculative_chain(
            DecodingEngine(target), OracleProposer(plain.tokens, 0.2, i), prompt, 40, k, eos=set()
        )
        assert spec.tokens == plain.tokens
        accepted_all += spec.accepted_per_cycle
    assert 0 in accepted_all and k in accepted_all  # both paths exercised


def test_eagle_and_prompt_lookup_are_lossless_on_many_prompts(target):
    cfg = drafter_config(target.config, 20, [1, 3, 4])
    torch.manual_seed(1)
    drafter = Eagle3Drafter(cfg).double()
    drafter.set_draft_vocab(torch.arange(0, 40, 2))
    eagle = EagleProposer(drafter, target.get_input_embeddings())
    for prompt in prompts(20):
        plain = plain_decode(DecodingEngine(target), prompt, 30, eos={7})
        for proposer in (eagle, PromptLookupProposer()):
            spec = speculative_chain(DecodingEngine(target), proposer, prompt, 30, 3, eos={7})
            assert spec.tokens == plain.tokens


def test_perfect_drafts_give_tau_k_plus_one(target):
    prompt = prompts(1)[0]
    plain = plain_decode(DecodingEngine(target), prompt, 33, eos=set())
    spec = speculative_chain(
        DecodingEngine(target), OracleProposer(plain.tokens, 0.0, 0), prompt, 33, 4, set()
    )
    assert spec.tokens == plain.tokens
    # 1 token from prefill, then 32 tokens in cycles of 4 drafts + 1 bonus
    assert spec.accepted_per_cycle[:6] == [4] * 6
    assert pooled_tau(spec.accepted_per_cycle[:6]) == 5.0


def test_tau_and_per_position_definitions():
    assert pooled_tau([0, 1, 3]) == (1 + 2 + 4) / 3
    assert per_position_acceptance([0, 1, 3], 3) == [2 / 3, 1 / 3, 1 / 3]


def test_first_divergence_and_tie_tolerances():
    from eagletrain.decode.chain import TIE_TOLERANCE, Decoded, first_divergence

    plain = Decoded([1, 2, 3, 4], 0.0, [], [2.0, 0.0, 1.0, 3.0])
    assert first_divergence(plain, Decoded([1, 2, 3, 4], 0.0)) is None
    assert first_divergence(plain, Decoded([1, 5, 3, 4], 0.0)) == 1
    assert first_divergence(plain, Decoded([1, 2], 0.0)) == 2
    assert (
        TIE_TOLERANCE[torch.float64] < TIE_TOLERANCE[torch.float32] < TIE_TOLERANCE[torch.bfloat16]
    )


# ---- sampling (T > 0): the output distribution is the target's --------------------------


def _exact_second_token(model, prompt: list[int], temperature: float) -> torch.Tensor:
    """P(second generated token) under plain sampling, computed exactly."""
    with torch.no_grad():
        first = torch.softmax(model(torch.tensor([prompt])).logits[0, -1] / temperature, -1)
        rows = torch.stack(
            [
                torch.softmax(model(torch.tensor([[*prompt, t]])).logits[0, -1] / temperature, -1)
                for t in range(first.numel())
            ]
        )
    return first @ rows


def _empirical(samples: list[int], size: int) -> torch.Tensor:
    return torch.bincount(torch.tensor(samples), minlength=size).double() / len(samples)


def null_threshold(exact: torch.Tensor, n: int, gen: torch.Generator) -> float:
    """The largest total-variation distance of 400 draws of n samples from `exact` itself:
    how far a correct sampler's empirical distribution can land from it by chance."""
    null = [
        0.5
        * (_empirical(torch.multinomial(exact, n, True, generator=gen).tolist(), 50) - exact)
        .abs()
        .sum()
        for _ in range(400)
    ]
    return float(max(null))


def test_speculative_sampling_matches_the_target_distribution():
    from eagletrain.decode.target_session import TargetSession

    torch.manual_seed(11)
    model = LlamaForCausalLM(tiny_llama_config(tie_word_embeddings=False)).double().eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(6.0)  # a peaked distribution, far from the drafter's
    cfg = drafter_config(model.config, 20, [1, 3, 4])
    drafter = Eagle3Drafter(cfg).double()
    drafter.set_draft_vocab(torch.arange(0, 40, 2))
    eagle = EagleProposer(drafter, model.get_input_embeddings())
    prompt, temperature, n = [5, 17, 3, 9], 1.0, 1000
    exact = _exact_second_token(model, prompt, temperature)
    gen = torch.Generator().manual_seed(0)
    threshold = null_threshold(exact, n, gen)
    for proposer in (eagle, PromptLookupProposer(vocab_size=50)):
        second = [
            speculative_chain(
                DecodingEngine(model), proposer, prompt, 2, 3, set(), temperature, gen
            ).tokens[1]
            for _ in range(n)
        ]
        tv = 0.5 * (_empirical(second, 50) - exact).abs().sum()
        assert tv <= threshold, (type(proposer).__name__, float(tv), threshold)
    # The test can fail: taking the drafter's token without the acceptance test is lossy.
    _, features = TargetSession(model, [1, 3, 4]).forward(prompt)
    lossy = []
    for _ in range(n):
        eagle.start(prompt, int(torch.multinomial(exact, 1, generator=gen)), features)
        lossy.append(eagle.propose_sampled(1, temperature, gen)[0][0])
    assert 0.5 * (_empirical(lossy, 50) - exact).abs().sum() > 3 * threshold
