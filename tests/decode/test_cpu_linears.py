"""oneDNN-prepacked linear layers for CPU decoding (decode/cpu_linears.py): the same
outputs as nn.Linear up to float32 rounding, and speculative decoding on a prepacked target
and drafter still equals plain greedy decoding on them."""

from __future__ import annotations

import pytest
import torch
from test_speculative import prompts, target  # noqa: F401
from test_tree import random_eagle

from eagletrain.decode import cpu_linears
from eagletrain.decode.chain import plain_decode, speculative_chain
from eagletrain.decode.engine import DecodingEngine

pytestmark = pytest.mark.skipif(
    not cpu_linears.usable(torch.device("cpu"), torch.float32), reason="no oneDNN here"
)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 4, 7])
def test_packed_linear_computes_what_linear_does(bias, rows):
    torch.manual_seed(0)
    linear = torch.nn.Linear(96, 200, bias=bias)
    x = torch.randn(2, rows, 96)
    with torch.inference_mode():
        torch.testing.assert_close(cpu_linears.PackedLinear(linear)(x), linear(x))


def test_prepacked_target_and_drafter_decode_losslessly(target):  # noqa: F811
    import copy

    model = copy.deepcopy(target).float()
    drafter = random_eagle(target).drafter.float()
    reference = DecodingEngine(copy.deepcopy(model))
    cpu_linears.prepack_linears(model)
    cpu_linears.prepack_linears(drafter)
    assert not any(isinstance(m, torch.nn.Linear) for m in [*model.modules(), *drafter.modules()])
    engine = DecodingEngine(model)
    with torch.inference_mode():
        for prompt in prompts(4):
            plain = plain_decode(engine, prompt, 24, set())
            spec = speculative_chain(engine, engine.eagle(drafter), prompt, 24, 3, set())
            assert spec.tokens == plain.tokens
            # and the packed model is the model: the same greedy text as unpacked
            assert plain.tokens == plain_decode(reference, prompt, 24, set()).tokens
