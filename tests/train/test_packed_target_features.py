"""Online training's target forward over packed rows gives each sample the features its
own forward gives: attention stays within the sample and positions restart, with no
attention mask passed (transformers reads the bounds from the position ids)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaForCausalLM

from eagletrain.target import packed_target_features, target_features
from eagletrain.train.batches import pack_tokens


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_packed_rows_give_each_sample_its_own_features(tiny_target, attention):
    model = LlamaForCausalLM.from_pretrained(tiny_target, attn_implementation=attention)
    model.eval()
    torch.manual_seed(3)
    lengths = [[7, 19, 5], [30], [12, 12]]
    rows = [[(torch.randint(3, 200, (n,)), torch.rand(n) < 0.7) for n in row] for row in lengths]
    batch = pack_tokens(rows, 32)
    aux, last = packed_target_features(model, batch.input_ids, batch.positions, [1, 3, 5])
    assert aux.shape == (3, 32, 3 * 64) and last.shape == (3, 32, 64)
    for r, row in enumerate(rows):
        start = 0
        for ids, mask in row:
            n = ids.shape[0]
            one_aux, one_last = target_features(
                model, ids[None], torch.ones(1, n, dtype=torch.bool), [1, 3, 5]
            )
            torch.testing.assert_close(aux[r, start : start + n], one_aux[0], atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(
                last[r, start : start + n], one_last[0], atol=1e-5, rtol=1e-4
            )
            assert torch.equal(batch.loss_mask[r, start : start + n], mask)
            assert torch.equal(batch.positions[r, start : start + n], torch.arange(n))
            start += n
    # a wrong premise would show: the same rows with positions that do not restart differ
    joined = torch.arange(32).expand(3, 32)
    aux_joined, _ = packed_target_features(model, batch.input_ids, joined, [1, 3, 5])
    assert not torch.allclose(aux_joined[0, 7:26], aux[0, 7:26], atol=1e-3)
