"""The reduced draft vocabulary: the N most frequent target tokens among loss-masked tokens.

Cached under a name derived from everything it depends on (dataset digest, N, tokenizer /
target identity), so a mapping built for another dataset or size can never be reused.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def cache_name(dataset_digest: str, size: int, target_identity: str) -> str:
    key = hashlib.sha256(f"{dataset_digest}|{size}|{target_identity}".encode()).hexdigest()
    return f"draft_vocab-{size}-{key[:16]}.safetensors"


def build_draft_vocab(token_counts: torch.Tensor, size: int) -> torch.Tensor:
    """Target ids of the draft vocab, sorted ascending. With fewer distinct tokens than
    `size` in the data, the rest is filled with the lowest unused ids so the head keeps
    exactly `size` rows (a d2t size mismatch is a known failure, SpecForge PR#76)."""
    vocab = token_counts.numel()
    if size > vocab:
        raise ValueError(f"draft_vocab_size {size} exceeds the target vocab {vocab}")
    seen = int((token_counts > 0).sum())
    # stable tie-break by token id: sort by (-count, id)
    order = torch.argsort(-token_counts.double() * (vocab + 1) + torch.arange(vocab).double())
    chosen = order[: min(size, seen)]
    if len(chosen) < size:
        unused = torch.ones(vocab, dtype=torch.bool)
        unused[chosen] = False
        chosen = torch.cat([chosen, unused.nonzero().squeeze(1)[: size - len(chosen)]])
    return chosen.sort().values


def load_or_build(
    cache_dir: Path,
    dataset_digest: str,
    size: int,
    target_identity: str,
    count_tokens,
    vocab_size: int,
) -> torch.Tensor:
    path = cache_dir / cache_name(dataset_digest, size, target_identity)
    if path.is_file():
        return load_file(path)["draft_ids"]
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for ids in count_tokens():
        counts += torch.bincount(ids.long(), minlength=vocab_size)
    draft_ids = build_draft_vocab(counts, size)
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    save_file({"draft_ids": draft_ids, "token_counts": counts}, tmp)
    tmp.replace(path)
    return draft_ids
