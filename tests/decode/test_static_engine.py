"""The static decoding engine (preallocated target and drafter caches, optionally compiled
fixed-shape steps) decodes exactly as the eager engine: the same plain, chain and tree
outputs, the same drafts and drafted trees, the same accepted drafts per cycle and the same
target features, across prompts that reuse one cache."""

from __future__ import annotations

import pytest
import torch
from test_speculative import OracleProposer, prompts, target  # noqa: F401
from test_tree import OracleTree, random_eagle
from torch._dynamo.utils import counters

from eagletrain.decode.chain import plain_decode, speculative_chain
from eagletrain.decode.draft_cache import StaticDraftCache
from eagletrain.decode.engine import DecodingEngine
from eagletrain.decode.proposers import EagleProposer
from eagletrain.decode.target_session import StaticTarget, TargetSession
from eagletrain.decode.tree import TreeShape, draft_tree, speculative_tree
from eagletrain.evaluate.in_process import Decoding, evaluate_prompts

SHAPE = TreeShape(total_tokens=12, depth=4, topk=3)


def _recorded(proposer: EagleProposer) -> tuple[EagleProposer, list]:
    """The proposer, and the list its chain drafts and drafted trees are appended to."""
    seen: list = []
    propose = EagleProposer.propose.__get__(proposer)  # the method, not an earlier wrapper
    proposer.propose = lambda k: seen.append(propose(k)) or seen[-1]
    return proposer, seen


def _tree_recorder(seen: list):
    def drafting(proposer, shape):
        tree = draft_tree(proposer, shape)
        seen.append((tree.tokens, tree.parents))
        return tree

    return drafting


def static_engine(model, max_len: int, compile: bool = False) -> DecodingEngine:
    """A random drafter's static engine: the target's cache and the drafter's, warmed up as
    `DecodingEngine.sized` does for this file's chain 3 and SHAPE: one per evaluation."""
    drafter = random_eagle(model).drafter
    draft_cache = StaticDraftCache(drafter, 160, compile=compile)
    draft_cache.warm_up(range(1, SHAPE.depth + 2), [SHAPE.topk])
    kind = "compiled" if compile else "static"
    return DecodingEngine(model, kind, StaticTarget(model, max_len, compile), draft_cache)


def _same_decoding(model, engine: DecodingEngine, prompt_list: list[list[int]]) -> int:
    """Decode every prompt on the eager engine and on `engine` (the drafter's cache static
    too) and compare the outputs, the drafts of every cycle and the drafted trees; return
    the drafts accepted (so a caller can check that the cache surgery after acceptance
    ran)."""
    eager = DecodingEngine(model)
    drafter = engine.draft_cache.drafter
    eager_eagle, static_eagle = eager.eagle(drafter), engine.eagle(drafter)
    accepted = 0
    for i, prompt in enumerate(prompt_list):
        plain = plain_decode(eager, prompt, 30, set())
        assert plain_decode(engine, prompt, 30, set()).tokens == plain.tokens
        runs, drafts = [], []
        for eagle, on in ((eager_eagle, eager), (static_eagle, engine)):
            proposer, seen = _recorded(eagle)
            runs.append(speculative_chain(on, proposer, prompt, 30, 3, set()))
            speculative_tree(on, eagle, prompt, 30, SHAPE, set(), drafting=_tree_recorder(seen))
            drafts.append(seen)
        # the static run drafted on the static cache itself (an empty cache once read as
        # false, and every "static" run drafted on a growing one)
        assert static_eagle.cache is engine.draft_cache
        assert runs[0].tokens == runs[1].tokens == plain.tokens
        assert drafts[0] == drafts[1]
        for on in (eager, engine):
            oracle = OracleProposer(plain.tokens, 0.3, i)
            runs.append(speculative_chain(on, oracle, prompt, 30, 3, set()))
            oracle = OracleTree(plain.tokens, seed=i)
            runs.append(
                speculative_tree(on, oracle, prompt, 30, SHAPE, set(), drafting=oracle.draft)
            )
        chain, tree = (runs[2], runs[4]), (runs[3], runs[5])
        for on_eager, on_static in (chain, tree):
            assert on_eager.tokens == on_static.tokens == plain.tokens
            assert on_eager.accepted_per_cycle == on_static.accepted_per_cycle
            accepted += sum(on_static.accepted_per_cycle)
    return accepted


def test_static_engine_decodes_as_the_eager_engine(target):  # noqa: F811
    assert _same_decoding(target, static_engine(target, max_len=128), prompts(4)) > 0


@torch.inference_mode()
def test_static_engine_features_equal_the_hooked_layer_outputs(target):  # noqa: F811
    engine = StaticTarget(target, max_len=64)
    prompt = prompts(1)[0]
    eager = TargetSession(target, [1, 3, 4])
    static = engine.session([1, 3, 4])
    for tokens in (prompt, [5, 9, 11], [2]):
        (eager_logits, eager_features), (static_logits, static_features) = (
            eager.forward(tokens),
            static.forward(tokens),
        )
        torch.testing.assert_close(static_logits, eager_logits)
        torch.testing.assert_close(static_features, eager_features)


def test_full_static_cache_is_a_clear_error(target):  # noqa: F811
    session = StaticTarget(target, max_len=8).session(None)
    session.forward([1, 2, 3, 4, 5])
    with pytest.raises(ValueError, match="static cache of 8 positions is full"):
        session.forward([1, 2, 3, 4])


def test_compiled_static_engine_decodes_as_the_eager_engine(target):  # noqa: F811
    """torch.compile of the fixed-shape steps (CUDA graphs on a GPU; on this CPU the same
    graphs without them): one graph per step shape, reused across prompts."""
    torch._dynamo.reset()
    engine = static_engine(target, max_len=128, compile=True)
    first, second = prompts(2)
    assert _same_decoding(target, engine, [first]) > 0
    graphs = counters["stats"]["unique_graphs"]
    assert graphs >= 3  # plain, chain and tree steps at least
    assert _same_decoding(target, engine, [second]) > 0
    assert counters["stats"]["unique_graphs"] == graphs  # the next prompt compiled nothing


def test_evaluation_on_the_static_engine_measures_what_the_eager_one_does(target):  # noqa: F811
    drafter = random_eagle(target).drafter
    batch = [(f"p{i}", p) for i, p in enumerate(prompts(3))]
    results = {
        engine: evaluate_prompts(
            target, drafter, batch, Decoding(24, 3, 0.0, 0, SHAPE, engine), eos=set()
        )
        for engine in ("eager", "static")
    }
    eager, static = results["eager"], results["static"]
    assert static["engine"] == "static" and eager["engine"] == "eager"
    for key in ("tau", "cycles", "prompt_lookup_tau"):
        assert static[key] == eager[key]
    assert static["tree"]["tau"] == eager["tree"]["tau"]
