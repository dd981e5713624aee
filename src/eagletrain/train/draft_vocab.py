"""The reduced draft vocabulary: the N most frequent target tokens among loss-masked
(assistant) tokens, N fixed or the smallest that covers a share of them ("auto").

Token counts are cached under a name derived from what they depend on (dataset digest,
target identity), so counts made for another dataset are never reused; the vocabulary
follows from the counts and N.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from eagletrain.data.token_coverage import count_tokens, size_for_coverage


def build_draft_vocab(token_counts: torch.Tensor, size: int) -> torch.Tensor:
    """Target ids of the draft vocab, sorted ascending. With fewer distinct tokens than
    `size` in the data, the rest is filled with the lowest unused ids so the head keeps
    exactly `size` rows (a d2t size mismatch is a known failure, SpecForge PR#76). The full
    target vocabulary is a valid size."""
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


def cached_counts(
    cache_dir: Path,
    dataset_digest: str,
    target_identity: str,
    tokens: Callable[[], Iterable[torch.Tensor]],
    vocab_size: int,
) -> torch.Tensor:
    """The masked-token counts of a dataset, counted once and cached by what they depend on."""
    key = hashlib.sha256(f"{dataset_digest}|{target_identity}".encode()).hexdigest()[:16]
    path = cache_dir / f"token_counts-{key}.safetensors"
    if path.is_file():
        return load_file(path)["token_counts"]
    counts = count_tokens(tokens(), vocab_size)
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    save_file({"token_counts": counts}, tmp)
    tmp.replace(path)
    return counts


def resolve_size(counts: torch.Tensor, setting: int | str, share: float) -> int:
    """train.draft_vocab_size: a number, or "auto" (the smallest covering `share`)."""
    return size_for_coverage(counts, share) if setting == "auto" else int(setting)
