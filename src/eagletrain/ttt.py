"""Training-time test: unroll the drafter K steps on its own outputs and score each step
against the target's distribution (forward KL / soft cross-entropy over the draft vocab).

Index convention, for a sequence x with target features f: at index i, step k feeds token
x[i+1+k] and predicts x[i+2+k]; its target distribution is the target's logits at index
i+1+k restricted to the draft vocab. A position counts when x[i+2+k] is an assistant token
(loss mask) and the target's argmax there is in the draft vocab; each step's loss is
normalised by its own mask sum (not by all positions: EAGLE#340).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from eagletrain.drafter import KV, Eagle3Drafter


@dataclass
class TargetHead:
    """The target's frozen final norm and lm_head, for target logits from stored states."""

    norm_weight: torch.Tensor
    norm_eps: float
    lm_head: torch.Tensor  # [V, H]

    def distribution(
        self, last: torch.Tensor, draft_ids: torch.Tensor, t2d: torch.Tensor, chunk: int = 1024
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(softmax over the draft vocab [B,T,Vd], target argmax in draft vocab [B,T]),
        chunked over tokens so full-vocab logits never exist for the whole batch at once."""
        b, t, h = last.shape
        flat = last.reshape(-1, h)
        probs, in_vocab = [], []
        for s in range(0, flat.shape[0], chunk):
            x = flat[s : s + chunk].float()
            x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.norm_eps)
            logits = (x * self.norm_weight.float()) @ self.lm_head.float().T
            in_vocab.append(t2d[logits.argmax(-1)])
            probs.append(torch.softmax(logits[:, draft_ids], dim=-1))
        return (torch.cat(probs).view(b, t, -1), torch.cat(in_vocab).view(b, t))


def shift(x: torch.Tensor, by: int) -> torch.Tensor:
    """x[:, i + by] at index i, zero past the end."""
    if by == 0:
        return x
    pad = torch.zeros_like(x[:, :by])
    return torch.cat([x[:, by:], pad], dim=1)


@dataclass
class TTTResult:
    loss: torch.Tensor
    step_loss: list[float]
    step_acc: list[float]
    step_cond_acc: list[float]
    step_count: list[int]
    accepted: torch.Tensor  # [B, T] leading correct steps per index (for simulated tau)
    counted: torch.Tensor  # [B, T] bool: index counts for simulated tau


def ttt_forward(
    drafter: Eagle3Drafter,
    embed: torch.nn.Embedding,
    aux: torch.Tensor,  # [B, T, 3H]
    input_ids: torch.Tensor,  # [B, T] long
    loss_mask: torch.Tensor,  # [B, T] bool (False on padding)
    target_p: torch.Tensor,  # [B, T, Vd]
    target_in_vocab: torch.Tensor,  # [B, T] bool
    steps: int,
    step_weights: list[float],
    denominators: torch.Tensor | None = None,  # [steps]: mask sums over the global batch
) -> TTTResult:
    """With `denominators` (data parallelism), step k's loss is this rank's share of the
    global batch's: summed over ranks it equals the single-process loss."""
    b, t = input_ids.shape
    positions = torch.arange(t, device=aux.device).expand(b, t)
    hidden = drafter.fc(aux)
    past: list[KV] = []
    loss = aux.new_zeros((), dtype=torch.float32)
    chain = torch.ones(b, t, dtype=torch.bool, device=aux.device)
    accepted = torch.zeros(b, t, dtype=torch.long, device=aux.device)
    counted = shift(loss_mask, 2) & shift(target_in_vocab, 1)
    out = TTTResult(loss, [], [], [], [], accepted, counted)
    for k in range(steps):
        tokens = shift(input_ids, 1 + k)
        hidden = drafter.step_ttt(hidden, embed(tokens), positions + k, past)
        logits = drafter.logits(hidden).float()
        target = shift(target_p, 1 + k)
        mask = shift(loss_mask, 2 + k) & shift(target_in_vocab, 1 + k)
        denom = (mask.sum() if denominators is None else denominators[k]).clamp(min=1)
        step_loss = -(target * F.log_softmax(logits, dim=-1)).sum(-1)
        step_loss = (step_loss * mask).sum() / denom
        loss = loss + step_weights[k] * step_loss
        with torch.no_grad():
            correct = (logits.argmax(-1) == target.argmax(-1)) & mask
            prior = chain & mask
            out.step_loss.append(step_loss.item())
            out.step_acc.append(float(correct.sum() / denom))
            out.step_cond_acc.append(float((correct & chain).sum() / prior.sum().clamp(min=1)))
            out.step_count.append(int(mask.sum()))
            chain = chain & correct
            accepted += chain.long()
    out.loss = loss
    return out


def step_denominators(
    loss_mask: torch.Tensor, target_in_vocab: torch.Tensor, steps: int
) -> torch.Tensor:
    """Each TTT step's count of scored positions (the masks `ttt_forward` builds)."""
    return torch.stack(
        [(shift(loss_mask, 2 + k) & shift(target_in_vocab, 1 + k)).sum() for k in range(steps)]
    )


class TTTObjective(torch.nn.Module):
    """The drafter with its frozen embedding, as one module whose forward is the TTT unroll,
    so that DDP can wrap it; the drafter itself knows nothing of the parallelism."""

    def __init__(self, drafter: Eagle3Drafter, embed: torch.nn.Embedding):
        super().__init__()
        self.drafter, self.embed = drafter, embed.requires_grad_(False)

    def forward(self, *args: object, **kwargs: object) -> TTTResult:
        return ttt_forward(self.drafter, self.embed, *args, **kwargs)


def step_weights(steps: int, decay: float) -> list[float]:
    return [decay**k for k in range(steps)]
