"""Flex attention's block masks for the refilling decoder (decode/continuous.py), built
from what is known of each row or prompt instead of evaluating every (query, key) pair:
the step's one query a row against the row's own cache blocks, and a refill's prompts end
to end, each attending itself."""

from __future__ import annotations

import torch

BUCKET = 128  # flex's block size, and the cache width's multiple


def packed_causal_mask(prompt: torch.Tensor, positions: torch.Tensor):
    """Flex's block mask for prompts end to end (`prompt`, `positions`: each token's prompt
    and position in it): each token attends its own prompt's tokens up to itself. Built from
    the prompts' bounds, one entry per block pair, where `create_block_mask` evaluates
    every (query, key) pair: 268M of them for a 16,384-token refill."""
    from torch.nn.attention.flex_attention import BlockMask

    total = prompt.shape[0]
    blocks = -(-total // BUCKET)
    block = torch.arange(blocks, device=prompt.device)
    first = block * BUCKET  # each query block's first token
    # a query block reaches back to the start of the prompt its first token is in
    lowest = (first - positions[first]) // BUCKET
    kv_blocks = (block - lowest + 1).to(torch.int32)
    # entries past a block's count are never read
    kv_index = (lowest[:, None] + block[None]).clamp(max=blocks - 1)

    def same_prompt_causal(b, h, q_idx, kv_idx):
        return (prompt[q_idx] == prompt[kv_idx]) & (kv_idx <= q_idx)

    return BlockMask.from_kv_blocks(
        kv_blocks.view(1, 1, blocks), kv_index.to(torch.int32).view(1, 1, blocks, blocks),
        BLOCK_SIZE=BUCKET, mask_mod=same_prompt_causal, seq_lengths=(total, total),
    )  # fmt: skip


def flex_decode(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    pos: torch.Tensor,
    options: dict[str, int] | None = None,
):
    """Every query of row b (its group's heads, [n, kv heads, group, dim]) attending that
    row's columns <= pos[b], blocks past it skipped."""
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    n, queries, width = q.shape[0], q.shape[2], keys.shape[2]
    blocks = width // BUCKET
    kv_blocks = (pos // BUCKET + 1).to(torch.int32).view(n, 1, 1)
    kv_index = torch.arange(blocks, device=q.device, dtype=torch.int32).expand(n, 1, 1, blocks)

    def mask_mod(b, h, q_idx, kv_idx):
        return kv_idx <= pos[b]

    mask = BlockMask.from_kv_blocks(
        kv_blocks, kv_index.contiguous(), BLOCK_SIZE=BUCKET, mask_mod=mask_mod,
        seq_lengths=(queries, width),
    )  # fmt: skip
    return flex_attention(q, keys, values, block_mask=mask, kernel_options=options)
