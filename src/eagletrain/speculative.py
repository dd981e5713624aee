"""Greedy chain speculative decoding with an EAGLE-3 drafter, in plain PyTorch.

One cycle: the drafter proposes k tokens; the target scores [last token, drafts] in one
forward; the longest prefix of drafts matching the target's argmax is accepted, plus the
target's own next token (the bonus). Tokens per cycle = accepted + 1; tau is their mean
over all cycles of all prompts (pooled). Both caches are cropped to the accepted length.
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from eagletrain.drafter import DraftKVCache, Eagle3Drafter
from eagletrain.target import capture_layer_outputs


@dataclass
class Decoded:
    tokens: list[int]
    seconds: float
    accepted_per_cycle: list[int] = field(default_factory=list)


def _cache_argument(model: torch.nn.Module) -> str:
    # transformers renamed `past_key_values` to `cache` after 5.17 (the H200 has 5.17).
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


class TargetSession:
    """The target with a KV cache; each forward also returns the aux-layer features."""

    def __init__(self, model: torch.nn.Module, aux_layer_ids: list[int]):
        self.model = model
        self.aux_layer_ids = aux_layer_ids
        self.cache = DynamicCache()
        self.device = next(model.parameters()).device
        self._cache_kw = _cache_argument(model)

    def _run(self, ids: torch.Tensor):
        return self.model(input_ids=ids, use_cache=True, **{self._cache_kw: self.cache})

    def forward(self, tokens: list[int], features: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        ids = torch.tensor([tokens], device=self.device)
        if not features:
            return self._run(ids).logits[0], None
        with capture_layer_outputs(self.model, self.aux_layer_ids) as captured:
            out = self._run(ids)
        aux = torch.cat([captured[i][0] for i in self.aux_layer_ids], dim=-1)
        return out.logits[0], aux

    def crop(self, length: int) -> None:
        # A negative count (tokens to remove) is what both transformers 4.x and 5.x accept.
        excess = self.cache.get_seq_length() - length
        if excess > 0:
            self.cache.crop(-excess)


def _finish(tokens: list[int], max_new: int, eos: set[int]) -> list[int]:
    tokens = tokens[:max_new]
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1]
    return tokens


@torch.inference_mode()
def greedy_decode(model: torch.nn.Module, prompt: list[int], max_new: int, eos: set[int]) -> Decoded:
    """Plain greedy decoding on the same engine (same cache, same dtype) as the speculative loop."""
    start = time.perf_counter()
    session = TargetSession(model, [])
    logits, _ = session.forward(prompt, features=False)
    out = [int(logits[-1].argmax())]
    while len(out) < max_new and out[-1] not in eos:
        logits, _ = session.forward(out[-1:], features=False)
        out.append(int(logits[-1].argmax()))
    return Decoded(_finish(out, max_new, eos), time.perf_counter() - start)


@torch.inference_mode()
def speculative_greedy(
    model: torch.nn.Module,
    drafter: Eagle3Drafter,
    embed: torch.nn.Module,
    prompt: list[int],
    max_new: int,
    draft_steps: int,
    eos: set[int],
) -> Decoded:
    start = time.perf_counter()
    device = next(drafter.parameters()).device
    target = TargetSession(model, list(drafter.config.eagle_aux_layer_ids))
    logits, feats = target.forward(prompt, features=True)
    out = [int(logits[-1].argmax())]
    n = len(prompt)  # drafter indices 0..n-1 hold real (target-feature) entries
    dcache = DraftKVCache()

    def extend_drafter(feats: torch.Tensor, next_tokens: list[int], first: int) -> torch.Tensor:
        positions = torch.arange(first, first + len(next_tokens), device=device)[None]
        ids = torch.tensor([next_tokens], device=device)
        hidden = drafter.fc(feats[None].to(device))
        return drafter.step_cached(hidden, embed(ids), positions, dcache)[:, -1:]

    last_hidden = extend_drafter(feats, [*prompt[1:], out[0]], 0)
    accepted_per_cycle = []
    while len(out) < max_new and out[-1] not in eos:
        drafts: list[int] = []
        hidden = last_hidden
        for j in range(draft_steps):
            token = int(drafter.draft_to_target(drafter.logits(hidden)[0, -1].argmax()))
            drafts.append(token)
            if j + 1 < draft_steps:
                pos = torch.tensor([[n - 1 + j + 1]], device=device)
                emb = embed(torch.tensor([[token]], device=device))
                hidden = drafter.step_cached(hidden, emb, pos, dcache)
        logits, feats = target.forward([out[-1], *drafts], features=True)
        predicted = logits.argmax(-1).tolist()
        accepted = 0
        while accepted < draft_steps and drafts[accepted] == predicted[accepted]:
            accepted += 1
        new_tokens = [*drafts[:accepted], predicted[accepted]]
        accepted_per_cycle.append(accepted)
        target.crop(n + 1 + accepted)
        dcache.crop(n)
        last_hidden = extend_drafter(feats[: accepted + 1], new_tokens, n)
        n += accepted + 1
        out.extend(new_tokens)
    return Decoded(_finish(out, max_new, eos), time.perf_counter() - start, accepted_per_cycle)


def pooled_tau(accepted_per_cycle: list[int]) -> float:
    """Tokens per draft-verify cycle including the target's bonus token, pooled over cycles."""
    if not accepted_per_cycle:
        return 0.0
    return sum(a + 1 for a in accepted_per_cycle) / len(accepted_per_cycle)


def per_position_acceptance(accepted_per_cycle: list[int], draft_steps: int) -> list[float]:
    """Fraction of cycles whose j-th draft token (j = 1..k) was accepted."""
    cycles = max(len(accepted_per_cycle), 1)
    return [sum(a >= j for a in accepted_per_cycle) / cycles for j in range(1, draft_steps + 1)]
