"""Compact storage of captured hidden states: float8 (e4m3) with one float32 scale per token
and captured layer, beside the rows in the same shard. A tensor "aux" stored this way has a
companion "aux_scale" [N, layers]; readers decode it transparently (HiddenSamples)."""

from __future__ import annotations

import torch

from eagletrain.runtime.shards import SCALE_SUFFIX

__all__ = ["FP8", "SCALE_SUFFIX", "decode_fp8", "encode_fp8", "to_store_dtype"]

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448


def encode_fp8(x: torch.Tensor, blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, blocks * H] -> (float8 [N, blocks * H], float32 scales [N, blocks]): each
    token's block (one captured layer) is scaled so its largest magnitude maps to 448."""
    n = x.shape[0]
    x = x.float().view(n, blocks, -1)
    scale = (x.abs().amax(-1) / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    q = (x / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(n, -1), scale


def decode_fp8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    n, blocks = scale.shape
    return (q.float().view(n, blocks, -1) * scale.unsqueeze(-1)).view(n, -1)


def to_store_dtype(
    aux: torch.Tensor, last: torch.Tensor, aux_layers: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Captured rows in the storage dtype: (aux, last, float8 scales by tensor name, empty
    for other dtypes)."""
    if dtype != FP8:
        return aux.to(dtype), last.to(dtype), {}
    aux, aux_scale = encode_fp8(aux, aux_layers)
    last, last_scale = encode_fp8(last, 1)
    return aux, last, {"aux": aux_scale, "last": last_scale}
