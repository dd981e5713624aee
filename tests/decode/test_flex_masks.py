"""The refilling decoder's packed-prefill block mask, built from the prompts' bounds: it
lists exactly the blocks `create_block_mask` finds by evaluating every (query, key) pair,
and compiled flex attention with it equals dense attention (eager flex reads only the
mask function, so the block lists are checked compiled)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from eagletrain.decode.flex_masks import packed_causal_mask


def test_packed_mask_lists_the_blocks_of_every_pair_and_attends_as_dense():
    lengths = torch.tensor([150, 60, 200, 90, 170, 40, 3])  # bounds inside blocks
    n, total = len(lengths), int(lengths.sum())
    prompt = torch.repeat_interleave(torch.arange(n), lengths)
    positions = torch.arange(total) - (lengths.cumsum(0) - lengths)[prompt]
    allowed = (prompt[:, None] == prompt[None]) & torch.ones(total, total).tril().bool()

    mask = packed_causal_mask(prompt, positions)
    every_pair = create_block_mask(
        lambda b, h, q, k: (prompt[q] == prompt[k]) & (k <= q), None, None, total, total, "cpu"
    )
    assert torch.equal(mask.to_dense(), every_pair.to_dense())

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 4, total, 32) for _ in range(3))
    out = torch.compile(flex_attention)(q, k, v, block_mask=mask)
    dense = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
    torch.testing.assert_close(out, dense, atol=1e-5, rtol=1e-5)
