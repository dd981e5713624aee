"""The target as the decoding loops use it: a KV cache per prompt, forwards that also return
the aux-layer features the drafter needs, and cache edits after verification.

Two engines share one interface, so plain and speculative decoding always run on the same
one and a speedup compares like with like:
- `TargetSession` (eager): transformers' DynamicCache, grown and cropped per cycle;
- `StaticTarget` (static): one preallocated StaticCache reused by every prompt; cropping is
  moving a length; with `compile`, every step of a fixed token count (1 for plain decoding,
  k + 1 for a chain, the tree's size) runs as a torch.compile graph, which on a GPU is a
  CUDA graph (mode "reduce-overhead"). Prefill, whose length varies, runs eager.
"""

from __future__ import annotations

import inspect
from typing import Protocol

import torch
from transformers import DynamicCache, StaticCache

from eagletrain.decode.compiled import compiled_steps
from eagletrain.target import capture_layer_outputs


def cache_argument(model: torch.nn.Module) -> str:
    # transformers renamed `past_key_values` to `cache` after 5.17 (the H200 has 5.17).
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool attend-mask [batch, q, kv] as the additive float mask [batch, 1, q, kv] that
    the eager and the SDPA attention of transformers both read the same way."""
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return mask.masked_fill(~allowed, torch.finfo(dtype).min)[:, None]


class Session(Protocol):
    def forward(self, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]: ...

    def forward_tree(
        self, tokens: list[int], positions: list[int], tree_mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]: ...

    def keep(self, length: int, rows: list[int]) -> None: ...

    def crop(self, length: int) -> None: ...


class TargetSession:
    """Eager engine: the target with a DynamicCache; a forward can also return the aux-layer
    features."""

    def __init__(self, model: torch.nn.Module, aux_layer_ids: list[int] | None):
        self.model = model
        self.aux_layer_ids = aux_layer_ids
        self.cache = DynamicCache()
        self.device = next(model.parameters()).device
        self._cache_kw = cache_argument(model)

    def _run(self, **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
        kwargs |= {"use_cache": True, self._cache_kw: self.cache}
        if not self.aux_layer_ids:
            return self.model(**kwargs).logits[0], None
        with capture_layer_outputs(self.model, self.aux_layer_ids) as captured:
            logits = self.model(**kwargs).logits[0]
        return logits, torch.cat([captured[i][0] for i in self.aux_layer_ids], dim=-1)

    def forward(self, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self._run(input_ids=torch.tensor([tokens], device=self.device))

    def forward_tree(
        self, tokens: list[int], positions: list[int], tree_mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Score a token tree in one forward: `tree_mask` [n, n] (True = attend) says which
        of the new tokens each one sees; every one sees the whole cache."""
        past = self.cache.get_seq_length()
        allowed = torch.cat(
            [torch.ones(len(tokens), past, dtype=torch.bool), tree_mask.cpu()], dim=1
        ).to(self.device)
        return self._run(
            input_ids=torch.tensor([tokens], device=self.device),
            position_ids=torch.tensor([positions], device=self.device),
            attention_mask=additive_mask(allowed[None], next(self.model.parameters()).dtype),
        )

    def keep(self, length: int, rows: list[int]) -> None:
        """Keep the first `length` cache entries and then those of the given rows of the
        last forward (the accepted path of a tree), in that order."""
        index = torch.cat([torch.arange(length), length + torch.tensor(rows)]).to(self.device)
        for layer in self.cache.layers:
            layer.keys = layer.keys.index_select(-2, index)
            layer.values = layer.values.index_select(-2, index)

    def crop(self, length: int) -> None:
        # A negative count (tokens to remove) is what both transformers 4.x and 5.x accept.
        excess = self.cache.get_seq_length() - length
        if excess > 0:
            self.cache.crop(-excess)


class StaticTarget:
    """Static engine: one preallocated cache of `max_len` positions for every prompt, and
    (with `compile`) compiled fixed-shape steps. Create once per model and evaluation: the
    compiled graphs and the cache's addresses are reused across prompts."""

    def __init__(self, model: torch.nn.Module, max_len: int, compile: bool = False):
        self.model, self.max_len, self.compiled = model, max_len, compile
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.cache = StaticCache(config=model.config, max_cache_len=max_len)
        self.cache_kw = cache_argument(model)
        self.step = compiled_steps(model.forward, compile)

    def session(self, aux_layer_ids: list[int] | None) -> StaticTargetSession:
        self.cache.reset()
        return StaticTargetSession(self, aux_layer_ids)


class StaticTargetSession:
    """One prompt on a StaticTarget. Entries past `length` are stale and never attended:
    the causal mask (built from the cache positions) and the tree mask exclude them, and the
    next forward overwrites them. Returned logits are valid until the next forward."""

    def __init__(self, engine: StaticTarget, aux_layer_ids: list[int] | None):
        self.engine, self.aux_layer_ids = engine, aux_layer_ids
        self.length = 0

    def _run(
        self, tokens: list[int], positions: list[int], mask: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        e, n = self.engine, len(tokens)
        if self.length + n > e.max_len:
            raise ValueError(f"static cache of {e.max_len} positions is full ({self.length} + {n})")
        forward = e.model.forward if self.length == 0 else e.step  # prefill runs eager
        out = forward(
            input_ids=torch.tensor([tokens], device=e.device),
            position_ids=torch.tensor([positions], device=e.device),
            cache_position=torch.arange(self.length, self.length + n, device=e.device),
            attention_mask=mask,
            use_cache=True,
            output_hidden_states=bool(self.aux_layer_ids),
            **{e.cache_kw: e.cache},
        )
        self.length += n
        if not self.aux_layer_ids:
            return out.logits[0], None
        # hidden_states[i + 1] is decoder layer i's output; copied out of the graph's buffers
        aux = [out.hidden_states[i + 1][0] for i in self.aux_layer_ids]
        return out.logits[0], torch.cat(aux, dim=-1).clone()

    def forward(self, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self._run(tokens, list(range(self.length, self.length + len(tokens))), None)

    def forward_tree(
        self, tokens: list[int], positions: list[int], tree_mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        n, past = len(tokens), self.length
        allowed = torch.zeros(n, self.engine.max_len, dtype=torch.bool)
        allowed[:, :past] = True
        allowed[:, past : past + n] = tree_mask.cpu()
        mask = additive_mask(allowed[None].to(self.engine.device), self.engine.dtype)
        return self._run(tokens, positions, mask)

    def _set_length(self, length: int) -> None:
        # transformers' static layers write at their own counter (a tensor, in place)
        self.length = length
        for layer in self.engine.cache.layers:
            layer.cumulative_length.fill_(length)

    def keep(self, length: int, rows: list[int]) -> None:
        index = (length + torch.tensor(rows)).to(self.engine.device)
        for layer in self.engine.cache.layers:
            for buffer in (layer.keys, layer.values):  # in place: the graphs hold these addresses
                buffer[:, :, length : length + len(rows)] = buffer.index_select(-2, index)
        self._set_length(length + len(rows))

    def crop(self, length: int) -> None:
        if length < self.length:
            self._set_length(length)
