"""The held-out chain tau: served chain decoding replayed on the training unroll gives the
cycles a real decoding loop runs, one by one."""

from __future__ import annotations

import random

import torch
from test_drafter import tiny_llama_config
from transformers import LlamaForCausalLM

from eagletrain.decode.acceptance import tau_interval
from eagletrain.decode.chain import speculative_chain
from eagletrain.decode.engine import DecodingEngine
from eagletrain.decode.proposers import EagleProposer
from eagletrain.drafter import Eagle3Drafter, drafter_config
from eagletrain.target import target_features
from eagletrain.train.batches import Batch
from eagletrain.train.heldout import chain_cycles, replay_rows
from eagletrain.train.ttt import TargetHead, TTTSettings, step_weights, ttt_forward

AUX = [1, 3, 4]


def test_cycles_start_after_the_prefill_token_and_jump_past_accepted_drafts():
    # a reply at indices 1-6 (x[3..8] assistant tokens), another at 9-10
    startable = [False, True, True, True, True, True, True, False, False, True, True]
    leading = [5, 5, 2, 0, 3, 1, 1, 0, 0, 4, 0]
    # index 1 is the prefill's token; 2 accepts 2 -> 5 accepts 1 -> 7 is outside;
    # 9 is the next reply's prefill token; 10 accepts 0
    assert chain_cycles(leading, startable, 3) == [2, 1, 0]
    assert chain_cycles(leading, startable, 1) == [1, 1, 1, 0]  # 2 -> 4 -> 6, then 10
    [(tokens, cycles)] = replay_rows(torch.tensor([leading]), torch.tensor([startable]), 3)
    assert (tokens, cycles) == (2 + 1 + 0 + 3, 3)


def test_rows_replayed_one_by_one_give_the_totals_and_an_interval_around_them():
    startable = [[False] + [True] * 9, [False] + [True] * 9, [False] + [True] * 9]
    leading = [[3] * 10, [0] * 10, [1, 1, 0, 1, 0, 1, 0, 1, 0, 1]]
    rows = replay_rows(torch.tensor(leading), torch.tensor(startable), 3)
    # row 0: index 1 is the prefill's token; 2 accepts 3, 6 accepts 3, then the row ends
    assert rows[0] == (8, 2)
    assert rows[1] == (8, 8)  # every cycle accepts nothing: one token each, indices 2-9
    # each row's (tokens, cycles) is its own walk's: accepted drafts plus a bonus a cycle
    walks = [chain_cycles(a, s, 3) for a, s in zip(leading, startable, strict=True)]
    assert rows == [(sum(w) + len(w), len(w)) for w in walks]
    low, high = tau_interval(rows)
    tau = sum(t for t, _ in rows) / sum(c for _, c in rows)
    assert low < tau < high  # rows that differ: an interval of some width around the tau


def _trained_pair(steps: int) -> tuple[LlamaForCausalLM, Eagle3Drafter, TargetHead]:
    """A tiny target and a drafter trained briefly on its greedy text, so that drafts are
    accepted often enough for every path of a cycle to run."""
    torch.manual_seed(5)
    target = LlamaForCausalLM(tiny_llama_config(tie_word_embeddings=False)).double().eval()
    drafter = Eagle3Drafter(drafter_config(target.config, 50, AUX)).double()
    drafter.set_draft_vocab(torch.arange(50))
    inner = target.model
    head = TargetHead(
        inner.norm.weight.detach(), inner.norm.variance_epsilon, target.lm_head.weight.detach()
    )
    prompts = torch.randint(0, 50, (16, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        texts = target.generate(prompts, max_new_tokens=40, min_new_tokens=40, do_sample=False)
    inputs = _unroll_inputs(target, drafter, head, texts, 6)
    opt = torch.optim.Adam(drafter.parameters(), lr=2e-2)
    settings = TTTSettings(steps, step_weights(steps, 0.8))
    for _ in range(60):
        opt.zero_grad()
        ttt_forward(drafter, target.get_input_embeddings(), *inputs, settings).loss.backward()
        opt.step()
    return target, drafter, head


def _unroll_inputs(target, drafter, head, x: torch.Tensor, reply_start: int):
    """(batch, target distribution, target argmax in vocab) of `x`, replies from
    `reply_start` on."""
    mask = torch.zeros_like(x, dtype=torch.bool)
    mask[:, reply_start:] = True
    with torch.no_grad():
        aux, last = (t.clone() for t in target_features(target, x, torch.ones_like(mask), AUX))
        p, in_vocab = head.distribution(last, drafter.target_ids(), drafter.t2d)
    return Batch(aux, last, x, mask), p, in_vocab


def test_replayed_cycles_equal_served_chain_decoding():
    steps, chain = 4, 3
    target, drafter, head = _trained_pair(steps)
    settings = TTTSettings(steps, step_weights(steps, 0.8))
    rng = random.Random(1)
    served_all = []
    for _ in range(8):
        prompt = [rng.randrange(50) for _ in range(8)]
        proposer = EagleProposer(drafter, target.get_input_embeddings())
        served = speculative_chain(DecodingEngine(target), proposer, prompt, 48, chain, eos=set())
        x = torch.tensor([prompt + served.tokens])
        with torch.no_grad():
            inputs = _unroll_inputs(target, drafter, head, x, len(prompt))
            r = ttt_forward(drafter, target.get_input_embeddings(), *inputs, settings)
        replayed = chain_cycles(r.accepted[0].tolist(), r.startable[0].tolist(), chain)
        # the last served cycle may be cut by max_new; every other one matches
        cut = len(served.accepted_per_cycle) - 1
        assert replayed[:cut] == served.accepted_per_cycle[:cut]
        served_all += served.accepted_per_cycle[:cut]
    assert 0 in served_all and chain in served_all  # rejections and full acceptance both ran
