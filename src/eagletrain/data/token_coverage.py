"""How well the N most frequent assistant tokens cover a dataset's assistant tokens: the
coverage curve the data stage reports and the "auto" draft vocabulary size follows."""

from __future__ import annotations

from collections.abc import Iterable

import torch

SIZE_MULTIPLE = 256  # an "auto" size is rounded up to this (a friendlier GEMM shape)
CURVE_SIZES = (4096, 8192, 16384, 24576, 32768)


def count_tokens(tokens: Iterable[torch.Tensor], vocab_size: int) -> torch.Tensor:
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for ids in tokens:
        counts += torch.bincount(ids.long(), minlength=vocab_size)
    return counts


def coverage(counts: torch.Tensor, size: int) -> float:
    """Share of the counted tokens that the `size` most frequent tokens are."""
    total = int(counts.sum())
    return float(counts.sort(descending=True).values[:size].sum()) / total if total else 1.0


def size_for_coverage(counts: torch.Tensor, share: float) -> int:
    """The smallest size (a multiple of SIZE_MULTIPLE, at most the vocabulary) whose most
    frequent tokens cover `share` of the counted tokens."""
    ordered = counts.sort(descending=True).values.double().cumsum(0)
    total = float(ordered[-1]) if len(ordered) else 0.0
    needed = int((ordered < share * total).sum()) + 1 if total else 1
    rounded = -(-needed // SIZE_MULTIPLE) * SIZE_MULTIPLE
    return min(rounded, counts.numel())


def coverage_curve(counts: torch.Tensor) -> dict[str, float | int]:
    """What a data set's token counts say about draft vocabulary sizes."""
    vocab = counts.numel()
    curve: dict[str, float | int] = {
        f"coverage_at_{n}": coverage(counts, n) for n in CURVE_SIZES if n < vocab
    }
    for share in (0.99, 0.995, 0.999):
        curve[f"size_for_{share}"] = size_for_coverage(counts, share)
    curve["distinct_tokens"] = int((counts > 0).sum())
    curve["counted_tokens"] = int(counts.sum())
    return curve
