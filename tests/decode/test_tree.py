"""Dynamic-tree speculative decoding: greedy output equals plain greedy decoding token for
token (random drafter; an oracle tree that holds the truth among noise siblings), the
drafter's tree attention scores every node as sequential decoding along its path would,
and tree sampling matches the target's distribution."""

from __future__ import annotations

import random

import torch
from test_speculative import (  # noqa: F401
    _empirical,
    _exact_second_token,
    null_threshold,
    prompts,
    target,
)
from transformers import LlamaForCausalLM

from eagletrain.decode.chain import plain_decode
from eagletrain.decode.engine import DecodingEngine
from eagletrain.decode.proposers import EagleProposer
from eagletrain.decode.target_session import TargetSession
from eagletrain.decode.tree import DraftTree, TreeShape, draft_tree, speculative_tree
from eagletrain.drafter import DraftKVCache, Eagle3Drafter, drafter_config


def random_eagle(model: LlamaForCausalLM, seed: int = 0) -> EagleProposer:
    torch.manual_seed(seed)
    drafter = Eagle3Drafter(drafter_config(model.config, 20, [1, 3, 4])).double().eval()
    drafter.set_draft_vocab(torch.arange(0, 40, 2))
    return EagleProposer(drafter, model.get_input_embeddings())


class OracleTree:
    """A tree holding the true greedy continuation on a path that breaks with a set
    probability, among wrong siblings at every depth."""

    aux_layer_ids = None

    def __init__(self, truth: list[int], seed: int):
        self.truth, self.rng = truth, random.Random(seed)

    def start(self, prompt, first, features):
        self.done = 1

    def advance(self, new_tokens, features):
        self.done += len(new_tokens)

    def draft(self, _proposer, shape: TreeShape) -> DraftTree:
        tokens, parents, depths = [], [], []
        parent = -1
        for depth in range(1, shape.depth + 1):
            want = (
                self.truth[self.done + depth - 1] if self.done + depth - 1 < len(self.truth) else 0
            )
            true_token = want if self.rng.random() < 0.8 else (want + 1) % 50
            siblings = [true_token, (want + 7) % 50, (want + 13) % 50]
            self.rng.shuffle(siblings)
            first = len(tokens)
            for t in siblings:
                tokens.append(t)
                parents.append(parent)
                depths.append(depth)
            parent = first + siblings.index(true_token)
        return DraftTree(tokens, parents, depths, [0.0] * len(tokens))


def test_tree_greedy_equals_plain_greedy(target):  # noqa: F811
    eagle = random_eagle(target)
    shape = TreeShape(total_tokens=12, depth=4, topk=3)
    accepted = 0
    for i, prompt in enumerate(prompts(12)):
        plain = plain_decode(DecodingEngine(target), prompt, 30, set())
        tree = speculative_tree(DecodingEngine(target), eagle, prompt, 30, shape, set())
        assert tree.tokens == plain.tokens
        oracle = OracleTree(plain.tokens, seed=i)
        guided = speculative_tree(
            DecodingEngine(target), oracle, prompt, 30, shape, set(), drafting=oracle.draft
        )
        assert guided.tokens == plain.tokens
        accepted += sum(guided.accepted_per_cycle)
    assert accepted > 0  # the oracle's paths were taken, so the cache surgery ran


@torch.no_grad()
def test_drafted_tree_scores_equal_sequential_decoding_along_each_path(target):  # noqa: F811
    eagle = random_eagle(target, seed=2)
    prompt = prompts(1)[0]
    _, features = TargetSession(target, eagle.aux_layer_ids).forward(prompt)
    eagle.start(prompt, 7, features)
    shape = TreeShape(total_tokens=20, depth=4, topk=3)
    tree = draft_tree(eagle, shape)
    assert len(tree.tokens) == 20
    drafter, real = eagle.drafter, eagle.real
    mask = tree.mask()
    for i, parent in enumerate(tree.parents):
        assert parent < i and (parent == -1 or tree.depths[parent] + 1 == tree.depths[i])
        ancestors = {0}
        node = i
        while node != -1:
            ancestors.add(node + 1)
            node = tree.parents[node]
        assert set(mask[i + 1].nonzero().flatten().tolist()) == ancestors
    eagle.cache.crop(real)
    for i in range(len(tree.tokens)):
        path = []
        node = i
        while node != -1:
            path.insert(0, node)
            node = tree.parents[node]
        cache = DraftKVCache()
        cache.k, cache.v = eagle.cache.k, eagle.cache.v
        hidden, score = eagle.last_hidden, 0.0
        for depth, node in enumerate(path, start=1):
            logp = torch.log_softmax(drafter.logits(hidden)[0, -1], -1)
            draft_id = int(drafter.t2d[: tree.tokens[node]].sum())  # target id -> draft id
            score += float(logp[draft_id])
            ids = torch.tensor([[tree.tokens[node]]])
            pos = torch.tensor([[real + depth - 1]])
            hidden = drafter.step_cached(hidden, eagle.embed(ids), pos, cache)
        assert abs(score - tree.scores[i]) < 1e-9, (i, score, tree.scores[i])


def test_tree_sampling_matches_the_target_distribution():
    torch.manual_seed(11)
    model = LlamaForCausalLM(_tiny_config()).double().eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(6.0)
    eagle = random_eagle(model, seed=1)
    prompt, temperature, n = [5, 17, 3, 9], 1.0, 1000
    exact = _exact_second_token(model, prompt, temperature)
    gen = torch.Generator().manual_seed(0)
    threshold = null_threshold(exact, n, gen)
    shape = TreeShape(total_tokens=8, depth=3, topk=3)
    second = [
        speculative_tree(
            DecodingEngine(model), eagle, prompt, 2, shape, set(), temperature, gen
        ).tokens[1]
        for _ in range(n)
    ]
    tv = 0.5 * (_empirical(second, 50) - exact).abs().sum()
    assert tv <= threshold, (float(tv), threshold)


def _tiny_config():
    from test_drafter import tiny_llama_config

    return tiny_llama_config(tie_word_embeddings=False)
