"""Greedy chain speculative decoding in plain PyTorch, with a pluggable proposer.

One cycle: the proposer drafts k tokens; the target scores [last token, drafts] in one
forward; the longest prefix of drafts equal to the target's argmax is accepted, plus the
target's own next token (the bonus). Tokens per cycle = accepted + 1; tau is their mean
over all cycles of all prompts (pooled). The target's cache is cropped to what was
accepted, and the proposer is told which tokens (and target features) became real.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from eagletrain.drafter import DraftKVCache, Eagle3Drafter
from eagletrain.static_draft_cache import StaticDraftCache
from eagletrain.target_session import StaticTarget, open_session


@dataclass
class Decoded:
    tokens: list[int]
    seconds: float
    accepted_per_cycle: list[int] = field(default_factory=list)
    # plain decoding only: top-1 minus top-2 logit at each step (how close to a tie it was)
    margins: list[float] = field(default_factory=list)


def _margin(logits: torch.Tensor) -> float:
    top = logits.float().topk(2).values
    return float(top[0] - top[1])


class Proposer(Protocol):
    """Drafts tokens; learns after each verification which tokens became real."""

    aux_layer_ids: list[int] | None  # target features it needs, None for none

    def start(self, prompt: list[int], first: int, features: torch.Tensor | None) -> None: ...

    def propose(self, k: int) -> list[int]: ...

    def advance(self, new_tokens: list[int], features: torch.Tensor | None) -> None: ...

    def propose_sampled(
        self, k: int, temperature: float, generator: torch.Generator
    ) -> tuple[list[int], torch.Tensor]: ...


class EagleProposer:
    """EAGLE-3 chain drafting. Drafter index i pairs the target feature of position i with
    token i+1; the k-th draft step runs at rope position (last real index) + k."""

    def __init__(
        self,
        drafter: Eagle3Drafter,
        embed: torch.nn.Module,
        static_cache: StaticDraftCache | None = None,
    ):
        """`static_cache`: the static engine's drafter cache (else a growing one per prompt)."""
        self.drafter, self.embed, self.static_cache = drafter, embed, static_cache
        self.aux_layer_ids = list(drafter.config.eagle_aux_layer_ids)
        self.device = next(drafter.parameters()).device

    def step(
        self,
        hidden: torch.Tensor,
        embeds: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One drafter forward over new positions, appended to this prompt's cache."""
        if isinstance(self.cache, StaticDraftCache):
            return self.cache.step(hidden, embeds, positions, mask)
        return self.drafter.step_cached(hidden, embeds, positions, self.cache, mask)

    def _extend(self, features: torch.Tensor, next_tokens: list[int]) -> None:
        first = len(self.cache)
        positions = torch.arange(first, first + len(next_tokens), device=self.device)[None]
        ids = torch.tensor([next_tokens], device=self.device)
        hidden = self.drafter.fc(features[None].to(self.device))
        out = self.step(hidden, self.embed(ids), positions)
        self.real, self.last_hidden = first + len(next_tokens), out[:, -1:]

    def start(self, prompt: list[int], first: int, features: torch.Tensor | None) -> None:
        self.cache = self.static_cache.reset() if self.static_cache is not None else DraftKVCache()
        self._extend(features, [*prompt[1:], first])

    def propose(self, k: int) -> list[int]:
        """The drafts stay on the device until all k are drafted: one read to the host."""
        drafts, hidden = [], self.last_hidden
        positions = torch.arange(self.real, self.real + k, device=self.device)
        for j in range(k):
            token = self.drafter.draft_to_target(self.drafter.logits(hidden)[0, -1].argmax())
            drafts.append(token)
            if j + 1 < k:
                hidden = self.step(hidden, self.embed(token.view(1, 1)), positions[j].view(1, 1))
        return torch.stack(drafts).tolist()

    def advance(self, new_tokens: list[int], features: torch.Tensor | None) -> None:
        self.cache.crop(self.real)
        self._extend(features, new_tokens)

    def propose_sampled(
        self, k: int, temperature: float, generator: torch.Generator
    ) -> tuple[list[int], torch.Tensor]:
        """Drafts sampled from the drafter, with their proposal distributions q over the
        target vocab ([k, V]; zero outside the draft vocab)."""
        drafts, rows, hidden = [], [], self.last_hidden
        target_ids = self.drafter.target_ids()
        for j in range(k):
            q_draft = torch.softmax(self.drafter.logits(hidden)[0, -1].double() / temperature, -1)
            d = int(torch.multinomial(q_draft.cpu(), 1, generator=generator))
            q = torch.zeros(self.drafter.config.vocab_size, dtype=torch.float64)
            q[target_ids.cpu()] = q_draft.cpu()
            token = int(target_ids[d])
            drafts.append(token)
            rows.append(q)
            if j + 1 < k:
                pos = torch.tensor([[self.real + j]], device=self.device)
                emb = self.embed(torch.tensor([[token]], device=self.device))
                hidden = self.step(hidden, emb, pos)
        return drafts, torch.stack(rows)


class PromptLookupProposer:
    """Prompt-lookup (n-gram) drafting: continue the latest earlier occurrence of the
    trailing n-gram of the text so far. A baseline needing no trained drafter."""

    aux_layer_ids = None

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, vocab_size: int = 0):
        self.max_ngram, self.min_ngram, self.vocab_size = max_ngram, min_ngram, vocab_size

    def start(self, prompt: list[int], first: int, features: torch.Tensor | None) -> None:
        self.text = [*prompt, first]

    def propose(self, k: int) -> list[int]:
        text = self.text
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            if len(text) <= n:
                continue
            tail = text[-n:]
            for start in range(len(text) - n - 1, -1, -1):
                if text[start : start + n] == tail:
                    follow = text[start + n : start + n + k]
                    if follow:
                        return follow + [follow[-1]] * (k - len(follow))
        return [text[-1]] * k

    def advance(self, new_tokens: list[int], features: torch.Tensor | None) -> None:
        self.text.extend(new_tokens)

    def propose_sampled(
        self, k: int, temperature: float, generator: torch.Generator
    ) -> tuple[list[int], torch.Tensor]:
        """Deterministic drafts: their proposal distributions are one-hot."""
        drafts = self.propose(k)
        q = torch.zeros(k, self.vocab_size, dtype=torch.float64)
        q[torch.arange(k), torch.tensor(drafts)] = 1.0
        return drafts, q


def truncate_at_eos(tokens: list[int], max_new: int, eos: set[int]) -> list[int]:
    tokens = tokens[:max_new]
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1]
    return tokens


@torch.inference_mode()
def greedy_decode(
    model: torch.nn.Module,
    prompt: list[int],
    max_new: int,
    eos: set[int],
    engine: StaticTarget | None = None,
) -> Decoded:
    """Plain greedy decoding on the same engine (same cache, same dtype) as the speculative loop."""
    start = time.perf_counter()
    target = open_session(model, None, engine)
    logits, _ = target.forward(prompt)
    out, margins = [int(logits[-1].argmax())], [_margin(logits[-1])]
    while len(out) < max_new and out[-1] not in eos:
        logits, _ = target.forward(out[-1:])
        out.append(int(logits[-1].argmax()))
        margins.append(_margin(logits[-1]))
    return Decoded(truncate_at_eos(out, max_new, eos), time.perf_counter() - start, [], margins)


# Largest top-2 logit margin still treated as a numerical tie. Greedy speculative decoding
# is exact in exact arithmetic; in low precision, scoring k+1 tokens in one forward rounds
# differently from one-at-a-time decoding, so a near-tie can flip (seen on the H200 in bf16).
TIE_TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-3, torch.bfloat16: 0.5, torch.float16: 0.1}


def first_divergence(plain: Decoded, other: Decoded) -> int | None:
    for i, (a, b) in enumerate(zip(plain.tokens, other.tokens, strict=False)):
        if a != b:
            return i
    if len(plain.tokens) != len(other.tokens):
        return min(len(plain.tokens), len(other.tokens))
    return None


@torch.inference_mode()
def _speculate(
    model: torch.nn.Module,
    proposer: Proposer,
    prompt: list[int],
    max_new: int,
    eos: set[int],
    pick: Callable[[torch.Tensor], int],
    draft: Callable[[], tuple[list[int], torch.Tensor | None]],
    verify: Callable[[list[int], torch.Tensor | None, torch.Tensor], tuple[int, int]],
    engine: StaticTarget | None = None,
) -> Decoded:
    """The draft-verify loop shared by greedy decoding and sampling: `pick` chooses a token
    from logits, `draft` proposes (drafts, their proposal distributions or None), `verify`
    returns (drafts accepted, the target's own next token)."""
    start = time.perf_counter()
    target = open_session(model, proposer.aux_layer_ids, engine)
    logits, features = target.forward(prompt)
    out = [pick(logits[-1])]
    proposer.start(prompt, out[0], features)
    accepted_per_cycle = []
    while len(out) < max_new and out[-1] not in eos:
        verified = len(prompt) + len(out) - 1  # target cache length before this cycle
        drafts, q = draft()
        logits, features = target.forward([out[-1], *drafts])
        accepted, token = verify(drafts, q, logits)
        new_tokens = [*drafts[:accepted], token]
        accepted_per_cycle.append(accepted)
        target.crop(verified + 1 + accepted)
        proposer.advance(new_tokens, None if features is None else features[: accepted + 1])
        out.extend(new_tokens)
    return Decoded(
        truncate_at_eos(out, max_new, eos), time.perf_counter() - start, accepted_per_cycle
    )


def speculative_greedy(
    model: torch.nn.Module,
    proposer: Proposer,
    prompt: list[int],
    max_new: int,
    k: int,
    eos: set[int],
    engine: StaticTarget | None = None,
) -> Decoded:
    """Accept the longest draft prefix equal to the target's argmax, then its next argmax."""

    def verify(drafts: list[int], _q: torch.Tensor | None, logits: torch.Tensor):
        predicted = logits.argmax(-1).tolist()
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == predicted[accepted]:
            accepted += 1
        return accepted, predicted[accepted]

    return _speculate(
        model,
        proposer,
        prompt,
        max_new,
        eos,
        pick=lambda logits: int(logits.argmax()),
        draft=lambda: (proposer.propose(k), None),
        verify=verify,
        engine=engine,
    )


def sample_token(probs: torch.Tensor, generator: torch.Generator) -> int:
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))


@torch.inference_mode()
def sample_decode(
    model: torch.nn.Module,
    prompt: list[int],
    max_new: int,
    eos: set[int],
    temperature: float,
    generator: torch.Generator,
    engine: StaticTarget | None = None,
) -> Decoded:
    """Plain sampling on the same engine as speculative sampling."""
    start = time.perf_counter()
    target = open_session(model, None, engine)
    logits, _ = target.forward(prompt)
    out = [sample_token(torch.softmax(logits[-1].double() / temperature, -1), generator)]
    while len(out) < max_new and out[-1] not in eos:
        logits, _ = target.forward(out[-1:])
        out.append(sample_token(torch.softmax(logits[-1].double() / temperature, -1), generator))
    return Decoded(truncate_at_eos(out, max_new, eos), time.perf_counter() - start)


def speculative_sample(
    model: torch.nn.Module,
    proposer: Proposer,
    prompt: list[int],
    max_new: int,
    k: int,
    eos: set[int],
    temperature: float,
    generator: torch.Generator,
    engine: StaticTarget | None = None,
) -> Decoded:
    """Lossless speculative sampling (Leviathan et al.; Chen et al.): draft j is accepted with
    probability min(1, p(d)/q(d)); the first rejected position is resampled from
    norm(max(0, p - q)); if all k are accepted the bonus token comes from p. The output is
    distributed exactly as plain sampling from the target."""

    def probs(logits: torch.Tensor) -> torch.Tensor:
        return torch.softmax(logits.double().cpu() / temperature, -1)

    def verify(drafts: list[int], q: torch.Tensor | None, logits: torch.Tensor):
        p = probs(logits)
        for j, d in enumerate(drafts):
            u = float(torch.rand((), generator=generator, dtype=torch.float64))
            if u >= min(1.0, float(p[j, d] / q[j, d])):
                residual = (p[j] - q[j]).clamp(min=0)
                total = residual.sum()
                return j, sample_token(residual / total if total > 0 else p[j], generator)
        return len(drafts), sample_token(p[len(drafts)], generator)

    return _speculate(
        model,
        proposer,
        prompt,
        max_new,
        eos,
        pick=lambda logits: sample_token(probs(logits), generator),
        draft=lambda: proposer.propose_sampled(k, temperature, generator),
        verify=verify,
        engine=engine,
    )


def pooled_tau(accepted_per_cycle: list[int]) -> float:
    """Tokens per draft-verify cycle including the target's bonus token, pooled over cycles."""
    if not accepted_per_cycle:
        return 0.0
    return sum(a + 1 for a in accepted_per_cycle) / len(accepted_per_cycle)


def per_position_acceptance(accepted_per_cycle: list[int], k: int) -> list[float]:
    """Fraction of cycles whose j-th draft token (j = 1..k) was accepted."""
    cycles = max(len(accepted_per_cycle), 1)
    return [sum(a >= j for a in accepted_per_cycle) / cycles for j in range(1, k + 1)]
