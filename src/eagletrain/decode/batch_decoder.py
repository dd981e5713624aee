"""Batched decoding of fixed shape for local regeneration: one KV cache of `rows` x `width`
positions, allocated once and reused by every batch, and a decoding step that (with
`compile`) runs as one torch.compile graph, a CUDA graph on a GPU.

transformers' `generate` builds masks, grows its cache and launches each kernel from Python
at every step; on the H200 a 512-row SmolLM2 step took ~57 ms (eighth part's data stage),
where reading its weights and cache takes a few. Here a batch is padded to `rows` rows, its
left-padded prompts share one write column (transformers' static layers count it
themselves), and every decoding step has the same shapes:
tokens [rows, 1], positions [rows, 1] and an additive mask [rows, 1, 1, width]. Prefill,
whose length varies, runs eager. Rows past an end-of-sequence token run on (their tokens
are dropped) until every row has ended or `max_new` is reached.
"""

from __future__ import annotations

import torch
from transformers import StaticCache

from eagletrain.decode.compiled import compiled_steps
from eagletrain.decode.target_session import additive_mask, cache_argument

CHECK_EVERY = 8  # decoding steps between host reads of "has every row ended?"


class StaticBatchDecoder:
    def __init__(
        self,
        model: torch.nn.Module,
        rows: int,
        width: int,
        temperature: float = 0.0,
        compile: bool = False,
    ):
        self.model, self.rows, self.width, self.temperature = model, rows, width, temperature
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.cache = StaticCache(config=model.config, max_cache_len=width)
        self.cache_kw = cache_argument(model)
        self.step = compiled_steps(self._forward, compile)
        self.columns = torch.arange(width, device=self.device)

    def _next_tokens(self, logits: torch.Tensor) -> torch.Tensor:
        if self.temperature == 0:
            return logits.argmax(-1)
        # Gumbel-max: a sample of softmax(logits / T) without a host round trip
        noise = -torch.log(-torch.log(torch.rand_like(logits, dtype=torch.float32)))
        return (logits.float() / self.temperature + noise).argmax(-1)

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, allowed: torch.Tensor):
        """The next token of each row after `ids` [rows, queries], each query attending the
        cache columns `allowed` [rows, queries, width] gives it."""
        out = self.model(
            input_ids=ids,
            position_ids=positions,
            attention_mask=additive_mask(allowed, self.dtype),
            use_cache=True,
            logits_to_keep=1,
            **{self.cache_kw: self.cache},
        )
        return self._next_tokens(out.logits[:, -1])

    @torch.inference_mode()
    def generate(
        self, prompts: list[list[int]], max_new: int, eos: set[int], pad: int
    ) -> list[list[int]]:
        """Each prompt's new tokens, up to and including its first `eos` token, at most
        `max_new`. Prompts fill the first rows; the rest run a one-token dummy."""
        if not 0 < len(prompts) <= self.rows:
            raise ValueError(f"{len(prompts)} prompts for a decoder of {self.rows} rows")
        longest = max(len(p) for p in prompts)
        if longest + max_new > self.width:
            raise ValueError(f"{longest} + {max_new} tokens exceed the cache's {self.width}")
        rows = [*prompts, *([[pad]] * (self.rows - len(prompts)))]
        ids = torch.full((self.rows, longest), pad, dtype=torch.long)
        allowed = torch.zeros(self.rows, self.width, dtype=torch.bool)
        for r, prompt in enumerate(rows):
            ids[r, longest - len(prompt) :] = torch.tensor(prompt)
            allowed[r, longest - len(prompt) : longest] = True
        lengths = allowed.sum(1, keepdim=True)
        ids, allowed, lengths = (t.to(self.device) for t in (ids, allowed, lengths))
        positions = (allowed[:, :longest].cumsum(1) - 1).clamp(min=0)
        self.cache.reset()
        causal = self.columns[None, :] <= torch.arange(longest, device=self.device)[:, None]
        token = self._forward(ids, positions, allowed[:, None, :] & causal[None])  # eager
        generated = torch.empty(self.rows, max_new, dtype=torch.long, device=self.device)
        eos_ids = torch.tensor(sorted(eos), dtype=torch.long, device=self.device)
        ended = torch.zeros(self.rows, dtype=torch.bool, device=self.device)
        ended[len(prompts) :] = True
        steps = max_new
        for t in range(max_new):
            generated[:, t] = token
            ended |= torch.isin(token, eos_ids)
            if t + 1 == max_new or ((t + 1) % CHECK_EVERY == 0 and bool(ended.all())):
                steps = t + 1
                break
            allowed[:, longest + t] = True
            token = self.step(token[:, None], lengths + t, allowed[:, None, :]).clone()
        kept = generated[: len(prompts), :steps].tolist()
        return [_through_first(tokens, eos) for tokens in kept]


def _through_first(tokens: list[int], eos: set[int]) -> list[int]:
    end = next((j for j, t in enumerate(tokens) if t in eos), None)
    return tokens if end is None else tokens[: end + 1]
