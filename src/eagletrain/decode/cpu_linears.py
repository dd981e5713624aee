"""Linear layers in oneDNN's prepacked layout for decoding on a CPU.

A decoding step multiplies a few rows by every weight matrix; PyTorch's default CPU path
for that is far from the memory bandwidth oneDNN reaches with weights packed once: on this
project's 2-core CPU, SmolLM2's 49,152 x 576 lm_head took 10.9 ms a token (aten) against
5.2 ms (oneDNN), and a 4-token verification forward cost 1.37x a 1-token step against
1.08x (bench/serving_engines.py profiles it). Plain and speculative decoding both run on
the converted modules, so speedups stay like for like.
"""

from __future__ import annotations

import torch
from torch.utils import mkldnn


def prepack_linears(module: torch.nn.Module) -> torch.nn.Module:
    """Every float32 nn.Linear inside `module` (on the CPU) replaced, in place, by its
    oneDNN-prepacked form; inference only (the packed weights take no gradient)."""
    for name, child in module.named_children():
        if isinstance(child, torch.nn.Linear) and child.weight.dtype == torch.float32:
            setattr(module, name, mkldnn.MkldnnLinear(child, torch.float32))
        else:
            prepack_linears(child)
    return module


def usable(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()
