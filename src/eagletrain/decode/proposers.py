"""Who drafts: the EAGLE-3 drafter (chain drafting on its own cache) or prompt lookup (an
n-gram baseline that needs no training). Both learn after each verification which tokens
became real."""

from __future__ import annotations

from typing import Protocol

import torch

from eagletrain.decode.draft_cache import StaticDraftCache
from eagletrain.drafter import DraftKVCache, Eagle3Drafter


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
