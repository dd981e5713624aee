"""Linear layers in oneDNN's prepacked layout for decoding on a CPU.

A decoding step multiplies a few rows by every weight matrix; PyTorch's default CPU path
for that is far from what oneDNN reaches with weights packed once: on this project's
2-core CPU, SmolLM2's 49,152 x 576 lm_head took 10.4 ms for one token and 17.4 ms for a
4-token verification (aten) against 4.9 and 4.0 ms (oneDNN, packed), and a 576 x 1536
projection 189 against 73 us for 4 tokens. The packed weights are read by the same
operator torch.compile's CPU backend uses for frozen weights (`mkldnn._linear_pointwise`),
on dense inputs, so nothing is converted per call. Plain and speculative decoding both
run on the converted modules: speedups stay like for like.
"""

from __future__ import annotations

import torch
from torch import nn

# the rows a call is packed for: a chain-3 verification scores 4 tokens
PACKED_ROWS = 4


class PackedLinear(nn.Module):
    """nn.Linear for inference on a CPU, its weight in oneDNN's packed layout."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.register_buffer("weight", torch.ops.mkldnn._reorder_linear_weight(weight, PACKED_ROWS))
        bias = None if linear.bias is None else linear.bias.detach()
        self.register_buffer("bias", bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")


def prepack_linears(module: torch.nn.Module) -> torch.nn.Module:
    """Every float32 nn.Linear inside `module` (on the CPU) replaced, in place, by its
    packed form; inference only (the packed weights take no gradient)."""
    for name, child in module.named_children():
        if isinstance(child, nn.Linear) and child.weight.dtype == torch.float32:
            setattr(module, name, PackedLinear(child))
        else:
            prepack_linears(child)
    return module


def usable(device: torch.device, dtype: torch.dtype) -> bool:
    """On a CPU in float32 with oneDNN (and the packed-linear operator) available."""
    return (
        device.type == "cpu"
        and dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )
