"""Batched extraction gives each sample the hidden states it gets alone (padding and batch
neighbours must not leak in: a batching bug silently corrupts a dataset), and a sample
with non-finite states is flagged by name, not dropped."""

from __future__ import annotations

import torch

from eagletrain.extract.stage import forward_captured
from eagletrain.runtime.ledger import ItemRow
from eagletrain.target import TargetSource, load_target


def _item(key: str) -> ItemRow:
    return ItemRow(key, 0, "pending", None, None, None, None, None, None, None)


def _inputs(lengths: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    return [
        (
            torch.randint(3, 300, (n,), generator=gen, dtype=torch.int32),
            torch.ones(n, dtype=torch.uint8),
        )
        for n in lengths
    ]


def test_batched_equals_unbatched(tiny_target):
    model = load_target(TargetSource(tiny_target, "tiny"), "float32", torch.device("cpu"))
    inputs = _inputs([37, 5, 22, 37])
    items = [_item(f"s{i}") for i in range(4)]
    batched = forward_captured(model, items, inputs, [1, 3, 4], torch.float32)
    offset = 0
    for j, one in enumerate(inputs):
        alone = forward_captured(model, [items[j]], [one], [1, 3, 4], torch.float32)
        n = len(one[0])
        torch.testing.assert_close(
            batched.aux[offset : offset + n], alone.aux, atol=1e-5, rtol=1e-5
        )
        torch.testing.assert_close(
            batched.last[offset : offset + n], alone.last, atol=1e-5, rtol=1e-5
        )
        offset += n
    assert batched.finite.all()


def test_non_finite_sample_is_flagged(tiny_target):
    model = load_target(TargetSource(tiny_target, "tiny"), "float32", torch.device("cpu"))

    def poison(_module, _args, output):
        output = output[0] if isinstance(output, tuple) else output
        output[1, 2] = float("nan")  # second sample of the batch, one position

    handle = model.model.layers[3].register_forward_hook(poison)
    try:
        items = [_item(f"s{i}") for i in range(3)]
        out = forward_captured(model, items, _inputs([9, 9, 9]), [1, 3, 4], torch.float32)
    finally:
        handle.remove()
    assert out.finite.tolist() == [True, False, True]
