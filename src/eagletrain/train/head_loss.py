"""The drafter head's loss for one TTT step, fused: lm_head and soft cross-entropy against
the target distribution, computed chunk by chunk along the sequence, with the gradients
produced in the same pass. A step's full [B, T, draft_vocab] float32 logits never exist at
once, and nothing is recomputed in backward (the idea of Liger's fused linear
cross-entropy, in plain PyTorch).
"""

from __future__ import annotations

import functools

import torch

CHUNK_TOKENS = 8192  # logits rows per chunk (B x sequence slice)


def _chunk_math(
    logits: torch.Tensor, target: torch.Tensor, mask: torch.Tensor, grad_dtype: torch.dtype | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(masked loss sum, argmax, d loss / d logits or None) of one chunk of logits."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    logp = torch.log_softmax(logits, dim=-1)
    loss = (-(target * logp).sum(-1) * mask).sum()
    grad = None
    if grad_dtype is not None:
        # d/dlogits of -sum_v t_v log softmax_v = softmax * sum_v t_v - t
        grad = (logp.exp() * target.sum(-1, keepdim=True) - target) * mask.unsqueeze(-1)
        grad = grad.to(grad_dtype)
    return loss, logits.argmax(-1), grad


@functools.cache
def _compiled_chunk_math():
    return torch.compile(_chunk_math)


def chunk_math(logits, target, mask, grad_dtype, compiled: bool):
    """Compiled, the chunk's softmax arithmetic is a few fused kernels (eager it is about
    eight passes over a [rows, draft_vocab] float32 block)."""
    math = _compiled_chunk_math() if compiled else _chunk_math
    return math(logits, target, mask, grad_dtype)


class _FusedHeadLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, target, mask, chunk, want_grad, compiled):
        """x [B, n, H] normed hidden, weight [Vd, H], target [B, n, Vd] (a distribution per
        row, or zeros), mask [B, n] float. Returns (sum of masked row losses, argmax [B, n])."""
        w = weight.to(x.dtype)
        loss = torch.zeros((), dtype=torch.promote_types(x.dtype, torch.float32), device=x.device)
        pred = torch.empty(x.shape[:2], dtype=torch.long, device=x.device)
        gx = torch.empty_like(x) if want_grad else None
        gw = torch.zeros_like(weight, dtype=loss.dtype) if want_grad else None
        for s in range(0, x.shape[1], chunk):
            xs, t, m = x[:, s : s + chunk], target[:, s : s + chunk], mask[:, s : s + chunk]
            part, pred[:, s : s + chunk], g = chunk_math(
                xs @ w.T, t, m, x.dtype if want_grad else None, compiled
            )
            loss += part
            if want_grad:
                gx[:, s : s + chunk] = g @ w
                gw += (g.flatten(0, 1).T @ xs.flatten(0, 1)).to(gw.dtype)
        ctx.save_for_backward(gx, gw)
        ctx.weight_dtype = weight.dtype
        ctx.mark_non_differentiable(pred)
        return loss, pred

    @staticmethod
    def backward(ctx, grad_loss, _grad_pred):
        gx, gw = ctx.saved_tensors
        return (
            (gx * grad_loss.to(gx.dtype)) if ctx.needs_input_grad[0] else None,
            (gw * grad_loss).to(ctx.weight_dtype) if ctx.needs_input_grad[1] else None,
            None,
            None,
            None,
            None,
            None,
        )


def head_loss(
    normed: torch.Tensor,  # [B, n, H]: the drafter's final norm applied
    weight: torch.Tensor,  # [Vd, H]: lm_head
    target: torch.Tensor,  # [B, n, Vd]
    mask: torch.Tensor,  # [B, n] bool
    chunk_tokens: int = CHUNK_TOKENS,
    compile_math: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum over masked rows of -sum_v target * log_softmax(normed @ weight.T), argmax of the
    logits [B, n]). Under autocast the matmuls run in the autocast dtype, the softmax in
    float32."""
    device = normed.device.type
    if torch.is_autocast_enabled(device):
        normed = normed.to(torch.get_autocast_dtype(device))
    want_grad = torch.is_grad_enabled() and (normed.requires_grad or weight.requires_grad)
    chunk = max(1, chunk_tokens // max(normed.shape[0], 1))
    with torch.autocast(device, enabled=False):
        return _FusedHeadLoss.apply(
            normed, weight, target, mask.to(torch.float32), chunk, want_grad, compile_math
        )
