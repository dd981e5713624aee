"""The TTT loss and its metrics against a slow reference written plainly: loops over
(sample, index, step), the drafter run as cached chain decoding, the target distribution
and masks computed position by position from the definitions in ttt.py's docstring."""

from __future__ import annotations

import math

import pytest
import torch
from test_drafter import tiny_drafter

from eagletrain.drafter import DraftKVCache
from eagletrain.train.batches import Batch
from eagletrain.train.head_loss import head_loss
from eagletrain.train.ttt import TargetHead, TTTSettings, step_weights, ttt_forward


def reference(drafter, embed, head, aux, last, ids, loss_mask, steps, weights):
    draft_ids = drafter.target_ids()
    b_size, t = ids.shape
    sums = [[0.0, 0, 0, 0, 0] for _ in range(steps)]  # loss, count, correct, chain_ok, chain_n
    for b in range(b_size):
        normed = last[b] * torch.rsqrt(last[b].pow(2).mean(-1, keepdim=True) + head.norm_eps)
        full = head.lm_head @ (head.norm_weight * normed).T  # target logits [V, T]
        for i in range(t):
            cache, out, chain = DraftKVCache(), None, True
            for k in range(steps):
                if i + 2 + k >= t:
                    break
                if k == 0:
                    out = drafter.step_cached(
                        drafter.fc(aux[b : b + 1, : i + 1]),
                        embed(ids[b : b + 1, 1 : i + 2]),
                        torch.arange(i + 1)[None],
                        cache,
                    )[:, -1:]
                else:
                    out = drafter.step_cached(
                        out,
                        embed(ids[b : b + 1, i + 1 + k : i + 2 + k]),
                        torch.tensor([[i + k]]),
                        cache,
                    )
                logits = full[:, i + 1 + k]
                counted = bool(loss_mask[b, i + 2 + k]) and bool(drafter.t2d[int(logits.argmax())])
                if not counted:
                    chain = False
                    continue
                if head.temperature == 0:  # all mass on the target's argmax
                    p = torch.zeros(len(draft_ids), dtype=logits.dtype)
                    p[int(logits[draft_ids].argmax())] = 1.0
                else:
                    p = torch.softmax(logits[draft_ids] / head.temperature, dim=0)
                q = torch.log_softmax(drafter.logits(out)[0, 0], dim=0)
                correct = int(q.argmax()) == int(p.argmax())
                sums[k][0] += float(-(p * q).sum())
                sums[k][1] += 1
                sums[k][2] += correct
                sums[k][3] += chain and correct
                sums[k][4] += chain
                chain = chain and correct
    step_loss = [s[0] / max(s[1], 1) for s in sums]
    loss = sum(w * x for w, x in zip(weights, step_loss, strict=True))
    acc = [s[2] / max(s[1], 1) for s in sums]
    cond = [s[3] / max(s[4], 1) for s in sums]
    return loss, step_loss, acc, cond


@pytest.mark.parametrize("temperature", [1.0, 0.5, 0.0])
def test_ttt_loss_and_metrics_equal_the_slow_reference(temperature: float):
    """At the target's own distribution, a sharpened one, and its argmax alone."""
    drafter, embed = tiny_drafter(seed=4)
    torch.manual_seed(5)
    b, t, steps = 2, 10, 3
    aux = torch.randn(b, t, 3 * 32, dtype=torch.float64)
    last = torch.randn(b, t, 32, dtype=torch.float64)
    ids = torch.randint(0, 50, (b, t))
    loss_mask = torch.rand(b, t) < 0.7
    loss_mask[1, 8:] = False  # padding at the end of the second sample
    # a head whose argmax is often in the draft vocab (even ids) and sometimes not
    head = TargetHead(
        torch.rand(32, dtype=torch.float64) + 0.5,
        1e-6,
        torch.randn(50, 32, dtype=torch.float64),
        temperature,
    )
    p, in_vocab = head.distribution(last, drafter.target_ids(), drafter.t2d)
    assert 0 < int(in_vocab.sum()) < in_vocab.numel()
    weights = step_weights(steps, 0.8)
    batch = Batch(aux, last, ids, loss_mask)
    got = ttt_forward(drafter, embed, batch, p, in_vocab, TTTSettings(steps, weights))
    with torch.no_grad():
        loss, step_loss, acc, cond = reference(
            drafter, embed, head, aux, last, ids, loss_mask, steps, weights
        )
    # ttt_forward takes the loss in float32 (as in bf16 training); the reference is float64
    assert math.isclose(got.loss.item(), loss, rel_tol=1e-6)
    for k in range(steps):
        assert math.isclose(got.step_loss[k], step_loss[k], rel_tol=1e-6)
        assert math.isclose(got.step_acc[k], acc[k], abs_tol=1e-6)
        assert math.isclose(got.step_cond_acc[k], cond[k], abs_tol=1e-6)


def test_fused_head_loss_gradients_equal_plain_autograd():
    torch.manual_seed(6)
    x = torch.randn(3, 7, 16, dtype=torch.float64, requires_grad=True)
    w = torch.randn(11, 16, dtype=torch.float64, requires_grad=True)
    target = torch.softmax(torch.randn(3, 7, 11, dtype=torch.float64), -1)
    mask = torch.rand(3, 7) < 0.6
    summed, pred = head_loss(x, w, target, mask, chunk_tokens=6)  # several chunks
    (gx, gw) = torch.autograd.grad(2.5 * summed, (x, w))
    logits = x @ w.T
    plain = (-(target * torch.log_softmax(logits, -1)).sum(-1) * mask).sum()
    (px, pw) = torch.autograd.grad(2.5 * plain, (x, w))
    torch.testing.assert_close(summed, plain)
    assert torch.equal(pred, logits.argmax(-1))
    torch.testing.assert_close(gx, px)
    torch.testing.assert_close(gw, pw)


def random_inputs(b: int, t: int, dtype=torch.float32):
    """(aux, ids, loss mask, target distribution over 20 draft ids, all in vocab) for the
    tiny drafter, drawn in that order from the current seed."""
    aux = torch.randn(b, t, 3 * 32, dtype=dtype)
    ids = torch.randint(0, 50, (b, t))
    mask = torch.rand(b, t) < 0.8
    p = torch.softmax(torch.randn(b, t, 20, dtype=dtype), -1)
    return aux, ids, mask, p, torch.ones(b, t, dtype=torch.bool)


def test_activation_recompute_gives_the_same_gradients():
    drafter, embed = tiny_drafter(seed=7)
    torch.manual_seed(8)
    b, t, steps = 2, 9, 3
    aux, ids, mask, p, in_vocab = random_inputs(b, t, torch.float64)
    grads = []
    for recompute in (False, True):
        drafter.zero_grad(set_to_none=True)
        settings = TTTSettings(steps, [1.0, 0.8, 0.64], recompute=recompute)
        r = ttt_forward(drafter, embed, Batch(aux, aux, ids, mask), p, in_vocab, settings)
        r.loss.backward()
        grads.append([q.grad.clone() for q in drafter.parameters()])
    for plain, recomputed in zip(*grads, strict=True):
        torch.testing.assert_close(plain, recomputed)


def test_compiled_decoder_layer_gives_the_same_loss_and_gradients():
    from eagletrain.drafter import compile_decoder_layer

    torch.manual_seed(9)
    b, t, steps = 2, 8, 3
    aux, ids, mask, p, in_vocab = random_inputs(b, t)
    results = []
    for compiled in (False, True):
        drafter, embed = tiny_drafter(seed=10)
        drafter, embed = drafter.float(), embed.float()
        if compiled:
            compile_decoder_layer(drafter)
        settings = TTTSettings(steps, [1.0, 0.8, 0.64])
        r = ttt_forward(drafter, embed, Batch(aux, aux, ids, mask), p, in_vocab, settings)
        r.loss.backward()
        results.append((r.loss.detach(), [q.grad.clone() for q in drafter.parameters()]))
    (eager_loss, eager_grads), (compiled_loss, compiled_grads) = results
    torch.testing.assert_close(compiled_loss, eager_loss, rtol=1e-5, atol=1e-6)
    for a, c in zip(eager_grads, compiled_grads, strict=True):
        torch.testing.assert_close(c, a, rtol=1e-4, atol=1e-6)


def test_flex_ttt_attention_equals_dense_and_compiles_one_graph_for_every_step():
    """The trainer's flex path (packed rows, every step's keys in one fixed layout) gives
    the dense reference's loss and figures, and the compiled decoder layer builds one graph
    for all TTT steps (one per step cost ~280 s of compiling on an H100). Forward only:
    flex_attention has no backward on the CPU."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from eagletrain.drafter import compile_decoder_layer, set_ttt_attention

    torch.manual_seed(11)
    b, t, steps = 2, 16, 4
    aux, ids, mask, p, in_vocab = random_inputs(b, t)
    # two samples in the first row, three in the second
    segments = torch.tensor([[1] * 9 + [2] * 7, [1] * 4 + [2] * 6 + [3] * 6])
    starts = torch.stack([torch.searchsorted(row, row) for row in segments])
    batch = Batch(aux, aux, ids, mask, positions=torch.arange(t) - starts, segments=segments)
    drafter, embed = tiny_drafter(seed=12)
    drafter, embed = drafter.float(), embed.float()
    settings = TTTSettings(steps, [1.0] * steps)
    results = []
    torch._dynamo.reset()
    with torch.no_grad():
        for mode in ("dense", "flex"):
            set_ttt_attention(drafter, mode)
            if mode == "flex":
                compile_decoder_layer(drafter)
                counters.clear()
            results.append(ttt_forward(drafter, embed, batch, p, in_vocab, settings))
    dense, flex = results
    torch.testing.assert_close(flex.loss, dense.loss, rtol=1e-5, atol=1e-6)
    assert flex.step_loss == pytest.approx(dense.step_loss, rel=1e-5)
    assert torch.equal(flex.accepted, dense.accepted)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
