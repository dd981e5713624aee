"""The drafter's decoding cache for the static engine (see target_session.py): keys and
values preallocated once per evaluation, steps of a fixed token count compiled."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from eagletrain.decode.compiled import compiled_steps
from eagletrain.drafter import Eagle3Drafter


class StaticDraftCache:
    """The drafter's decoding cache preallocated for `max_len` positions, reused by every
    prompt (`reset`); `crop` moves a length. With `compile`, steps after the prefill run as
    torch.compile graphs (CUDA graphs on a GPU), one per step shape, since nothing that
    varies between steps is a Python number inside them."""

    def __init__(self, drafter: Eagle3Drafter, max_len: int, compile: bool = False):
        cfg, weight = drafter.config, drafter.fc.weight
        shape = (1, cfg.num_key_value_heads, max_len, cfg.head_dim)
        self.keys = torch.zeros(shape, dtype=weight.dtype, device=weight.device)
        self.values = torch.zeros(shape, dtype=weight.dtype, device=weight.device)
        torch._dynamo.mark_static_address(self.keys)
        torch._dynamo.mark_static_address(self.values)
        self.drafter, self.max_len, self.length, self.compiled = drafter, max_len, 0, compile
        self.buffer_index = torch.arange(max_len, device=weight.device)
        self._compiled = compiled_steps(self._forward, compile)

    def __len__(self) -> int:
        return self.length

    def reset(self) -> StaticDraftCache:
        self.length = 0
        return self

    def crop(self, length: int) -> None:
        self.length = min(self.length, length)

    def _forward(self, hidden, embeds, positions, slots, allowed) -> torch.Tensor:
        cos, sin = self.drafter.rope(hidden, positions)
        kv = (self.keys, self.values)
        return self.drafter.midlayer(
            hidden, embeds, lambda attn, x: attn.forward_static(x, cos, sin, *kv, slots, allowed)
        )

    def step(
        self,
        hidden: torch.Tensor,
        embeds: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """As `Eagle3Drafter.step_cached`: causal over the cache, or as `mask` [new, cache +
        new] says (tree drafting). The output is a copy, safe across later steps."""
        n, device = hidden.shape[1], self.keys.device
        if self.length + n > self.max_len:
            raise ValueError(f"drafter cache of {self.max_len} positions is full")
        slots = torch.arange(self.length, self.length + n, device=device)
        if mask is None:
            allowed = self.buffer_index[None] <= slots[:, None]
        else:
            allowed = torch.zeros(n, self.max_len, dtype=torch.bool, device=device)
            allowed[:, : mask.shape[1]] = mask
        if self.length and self.compiled:  # a compiled step (the prefill runs eager)
            # graphs are specialised to strides too: a slice of an earlier output (its last
            # row) would compile one graph per width of that output
            hidden, embeds, positions = (
                x.clone(memory_format=torch.contiguous_format) for x in (hidden, embeds, positions)
            )
        forward = self._compiled if self.length else self._forward
        out = forward(hidden, embeds, positions, slots, allowed).clone()
        self.length += n
        return out

    @torch.inference_mode()
    def warm_up(self, sizes: Iterable[int], masked: Iterable[int]) -> None:
        """Compile and capture every step shape ahead of any timing: causal steps of each
        size in `sizes` (new tokens after a verification, drafts) and tree-masked steps of
        each size in `masked`. Three rounds, as CUDA graphs are recorded on a later call
        than the first. Under inference mode, as decoding runs: graphs recorded with autograd
        on would wait for a backward that never comes. The cache is left empty."""
        weight = self.drafter.fc.weight
        h = self.drafter.config.hidden_size

        def run(n: int, mask: bool) -> None:
            zeros = torch.zeros(1, n, h, dtype=weight.dtype, device=weight.device)
            positions = torch.arange(self.length, self.length + n, device=weight.device)[None]
            allowed = torch.ones(n, self.length + n, dtype=torch.bool, device=weight.device)
            self.step(zeros, zeros, positions, allowed if mask else None)

        sizes, masked = list(sizes), list(masked)
        for _ in range(3):
            self.reset()
            run(1, False)  # the prefill, eager
            for n in sizes:
                run(n, False)
            for n in masked:
                run(n, True)
        self.reset()
