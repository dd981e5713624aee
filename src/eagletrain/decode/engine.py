"""The decoding engine: how the target and the drafter's cache run for every decoding loop
(plain, chain, tree), so a speedup always compares like with like.

- "eager": transformers' DynamicCache per prompt, a growing drafter cache;
- "static": one preallocated target cache and one drafter cache, reused by every prompt;
- "compiled": static, with every fixed-shape step a torch.compile graph (CUDA graphs on a
  GPU). Build it once per evaluation: the graphs and the caches' addresses are reused.
"""

from __future__ import annotations

from typing import Literal

import torch

from eagletrain.decode.draft_cache import StaticDraftCache
from eagletrain.decode.proposers import EagleProposer
from eagletrain.decode.target_session import Session, StaticTarget, TargetSession
from eagletrain.drafter import Eagle3Drafter

EngineKind = Literal["eager", "static", "compiled"]


class DecodingEngine:
    def __init__(
        self,
        model: torch.nn.Module,
        kind: EngineKind = "eager",
        target: StaticTarget | None = None,
        draft_cache: StaticDraftCache | None = None,
    ):
        """Use `DecodingEngine(model)` for the eager engine, `DecodingEngine.sized` for the
        static and compiled ones."""
        self.model, self.kind = model, kind
        self.target, self.draft_cache = target, draft_cache

    @classmethod
    def sized(
        cls,
        model: torch.nn.Module,
        kind: EngineKind,
        drafter: Eagle3Drafter | None,
        longest_prompt: int,
        max_new_tokens: int,
        draft_steps: int,
        tree: tuple[int, int, int] | None = None,
    ) -> DecodingEngine:
        """An engine whose caches hold the longest prompt, its new tokens and one cycle's
        drafts; `tree` = (total tokens, depth, top-k) when tree decoding runs on it too.
        The compiled engine compiles and captures every drafter step shape here."""
        if kind == "eager":
            return cls(model)
        total, depth, topk = tree or (0, 0, 0)
        verify = max(draft_steps, total) + 1
        room = longest_prompt + max_new_tokens + verify
        compile = kind == "compiled"
        draft_cache = None
        if drafter is not None:
            # tree drafting appends up to (depth - 1) x topk nodes after the real prefix
            drafted = max((depth - 1) * topk, draft_steps)
            draft_cache = StaticDraftCache(drafter, room + drafted, compile)
            # new tokens per cycle: up to k + 1 (chain) or depth + 1 (tree); tree steps are
            # topk wide
            longest_step = max(draft_steps, depth) + 1
            draft_cache.warm_up(range(1, longest_step + 1), [topk] if tree else [])
        return cls(model, kind, StaticTarget(model, room, compile), draft_cache)

    def session(self, aux_layer_ids: list[int] | None) -> Session:
        """The target for one prompt (the static cache is reset for it)."""
        if self.target is not None:
            return self.target.session(aux_layer_ids)
        return TargetSession(self.model, aux_layer_ids)

    def eagle(self, drafter: Eagle3Drafter) -> EagleProposer:
        """The drafter as a chain/tree proposer on this engine's drafter cache."""
        return EagleProposer(drafter, self.model.get_input_embeddings(), self.draft_cache)
