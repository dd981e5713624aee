"""Training-time test: unroll the drafter K steps on its own outputs and score each step
against the target's distribution (forward KL / soft cross-entropy over the draft vocab;
`train.target_temperature` sharpens it, down to the argmax alone).

Index convention, for a sequence x with target features f: at index i, step k feeds token
x[i+1+k] and predicts x[i+2+k]; its target distribution is the target's logits at index
i+1+k restricted to the draft vocab. A position counts when x[i+2+k] is an assistant token
(loss mask) and the target's argmax there is in the draft vocab; each step's loss is
normalised by its own mask sum (not by all positions: EAGLE#340).

Packed rows (several samples in one row, `segments` numbering them) change three things
only: rope positions restart at each sample, step 0's attention stops at the sample's
start, and index i counts at step k only when x[i+2+k] belongs to the same sample.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

from eagletrain.drafter import KV, Eagle3Drafter
from eagletrain.train.batches import Batch
from eagletrain.train.head_loss import head_loss


@dataclass
class TargetHead:
    """The target's frozen final norm and lm_head, for target logits from stored states.
    `temperature` shapes the distribution the drafter learns: 1 the target's own, below 1
    sharper, 0 all mass on the target's argmax (what greedy decoding accepts)."""

    norm_weight: torch.Tensor
    norm_eps: float
    lm_head: torch.Tensor  # [V, H]
    temperature: float = 1.0

    def distribution(
        self, last: torch.Tensor, draft_ids: torch.Tensor, t2d: torch.Tensor, chunk: int = 1024
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the training target over the draft vocab [B,T,Vd]: the softmax at
        `temperature`; whether the target's argmax is in the draft vocab [B,T]),
        chunked over tokens so full-vocab logits never exist for the whole batch at once.
        On CUDA the lm_head matmul runs in bf16, as the target computes its own logits when
        served (a float32 GEMM here took a third of an 8B-shaped training step); the norm
        and the softmax are float32."""
        b, t, h = last.shape
        flat = last.reshape(-1, h)
        matmul_dtype = (
            torch.bfloat16
            if last.is_cuda
            else torch.promote_types(self.lm_head.dtype, torch.float32)
        )
        weight = self.lm_head.to(matmul_dtype)
        probs, in_vocab = [], []
        for s in range(0, flat.shape[0], chunk):
            x = flat[s : s + chunk].float()
            x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.norm_eps)
            x = (x * self.norm_weight.float()).to(matmul_dtype)
            logits = (x @ weight.T).float()
            in_vocab.append(t2d[logits.argmax(-1)])
            probs.append(self._shaped(logits[:, draft_ids]))
        return (torch.cat(probs).view(b, t, -1), torch.cat(in_vocab).view(b, t))

    def _shaped(self, logits: torch.Tensor) -> torch.Tensor:
        """The training target over the draft vocab at `temperature`."""
        if self.temperature == 0:
            one_hot = torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1])
            return one_hot.to(logits.dtype)
        return torch.softmax(logits / self.temperature, dim=-1)


def shift(x: torch.Tensor, by: int) -> torch.Tensor:
    """x[:, i + by] at index i, zero past the end."""
    if by == 0:
        return x
    pad = torch.zeros_like(x[:, :by])
    return torch.cat([x[:, by:], pad], dim=1)


def same_segment(segments: torch.Tensor | None, by: int) -> torch.Tensor | bool:
    """[B, T]: index i and index i + by hold the same sample (True without packing)."""
    if segments is None:
        return True
    return shift(segments, by) == segments


def step_mask(
    loss_mask: torch.Tensor,
    target_in_vocab: torch.Tensor,
    segments: torch.Tensor | None,
    k: int,
) -> torch.Tensor:
    """Where step k is scored: x[i+2+k] is an assistant token of the same sample and the
    target's argmax at i+1+k is in the draft vocab."""
    return shift(loss_mask, 2 + k) & shift(target_in_vocab, 1 + k) & same_segment(segments, 2 + k)


@dataclass
class TTTResult:
    loss: torch.Tensor
    step_loss: list[float]
    step_acc: list[float]
    step_cond_acc: list[float]
    step_count: list[int]
    accepted: torch.Tensor  # [B, T] leading correct steps per index (for simulated tau)
    counted: torch.Tensor  # [B, T] bool: index counts for simulated tau
    # [B, T] bool: x[i+2] is an assistant token of the same sample (a served cycle could
    # start at i, whether or not the target's token is in the draft vocab)
    startable: torch.Tensor


@dataclass(frozen=True)
class TTTSettings:
    """How a batch is unrolled and scored: TTT steps and their loss weights; `recompute`
    recomputes each step's decoder layer in backward (activation checkpointing) instead of
    keeping its activations; `compile_head` compiles the fused head loss's softmax
    arithmetic (GPUs)."""

    steps: int
    weights: list[float]
    recompute: bool = False
    compile_head: bool = False


def ttt_forward(
    drafter: Eagle3Drafter,
    embed: torch.nn.Embedding,
    batch: Batch,
    target_p: torch.Tensor,  # [B, T, Vd]
    target_in_vocab: torch.Tensor,  # [B, T] bool
    settings: TTTSettings,
    denominators: torch.Tensor | None = None,  # [steps]: mask sums over the global batch
    weight_scale: float = 1.0,
) -> TTTResult:
    """The TTT loss and figures of one batch. With `denominators` (data parallelism), step
    k's loss is this rank's share of the global batch's: summed over ranks (weights scaled
    by the world size, as DDP averages) it equals the single-process loss. The head's loss
    is fused (head_loss.py)."""
    aux, input_ids, loss_mask = batch.aux, batch.input_ids, batch.loss_mask
    positions, segments = batch.positions, batch.segments
    steps, recompute = settings.steps, settings.recompute
    step_weights = [w * weight_scale for w in settings.weights]
    b, t = input_ids.shape
    if positions is None:
        positions = torch.arange(t, device=aux.device).expand(b, t)
    hidden = drafter.fc(aux)
    past: list[KV] = []
    loss = aux.new_zeros((), dtype=torch.float32)
    chain = torch.ones(b, t, dtype=torch.bool, device=aux.device)
    accepted = torch.zeros(b, t, dtype=torch.long, device=aux.device)
    counted = step_mask(loss_mask, target_in_vocab, segments, 0)
    target_argmax = target_p.argmax(-1)
    startable = shift(loss_mask, 2) & same_segment(segments, 2)
    out = TTTResult(loss, [], [], [], [], accepted, counted, startable)
    figures: list[torch.Tensor] = []

    def decoder_step(hidden: torch.Tensor, tokens: torch.Tensor, k: int, *flat: torch.Tensor):
        earlier = list(zip(flat[0::2], flat[1::2], strict=True))
        return drafter.step_ttt(hidden, embed(tokens), positions + k, earlier, segments, steps)

    for k in range(steps):
        tokens = shift(input_ids, 1 + k)
        flat = [x for kv in past for x in kv]
        if recompute and torch.is_grad_enabled():
            hidden, kv = checkpoint(decoder_step, hidden, tokens, k, *flat, use_reentrant=False)
        else:
            hidden, kv = decoder_step(hidden, tokens, k, *flat)
        past.append(kv)
        # index i predicts the target's distribution at i + 1 + k: rows past t - 1 - k have
        # none, so the head runs on the first n rows against a view of target_p
        n = t - 1 - k
        mask = step_mask(loss_mask, target_in_vocab, segments, k)
        denom = (mask.sum() if denominators is None else denominators[k]).clamp(min=1)
        correct = torch.zeros_like(mask)
        step_loss = loss.new_zeros(())
        if n > 0:
            summed, pred = head_loss(
                drafter.norm(hidden[:, :n]),
                drafter.lm_head.weight,
                target_p[:, 1 + k :],
                mask[:, :n],
                compile_math=settings.compile_head,
            )
            step_loss = summed / denom
            correct[:, :n] = (pred == target_argmax[:, 1 + k :]) & mask[:, :n]
        loss = loss + step_weights[k] * step_loss
        with torch.no_grad():
            prior = chain & mask
            figures.append(
                torch.stack(
                    [
                        step_loss.detach().double(),
                        correct.sum() / denom,
                        (correct & chain).sum() / prior.sum().clamp(min=1),
                        mask.sum(),
                    ]
                ).double()
            )
            chain = chain & correct
            accepted += chain.long()
    out.loss = loss
    # one device-to-host transfer for all steps' figures, not one sync per figure
    for step_loss_k, acc, cond_acc, count in torch.stack(figures).tolist():
        out.step_loss.append(step_loss_k)
        out.step_acc.append(acc)
        out.step_cond_acc.append(cond_acc)
        out.step_count.append(int(count))
    return out


def step_denominators(
    loss_mask: torch.Tensor,
    target_in_vocab: torch.Tensor,
    steps: int,
    segments: torch.Tensor | None = None,
) -> torch.Tensor:
    """Each TTT step's count of scored positions (the masks `ttt_forward` builds)."""
    return torch.stack(
        [step_mask(loss_mask, target_in_vocab, segments, k).sum() for k in range(steps)]
    )


class TTTObjective(torch.nn.Module):
    """The drafter with its frozen embedding, as one module whose forward is the TTT unroll,
    so that DDP can wrap it; the drafter itself knows nothing of the parallelism."""

    def __init__(self, drafter: Eagle3Drafter, embed: torch.nn.Embedding, settings: TTTSettings):
        super().__init__()
        self.drafter, self.embed = drafter, embed.requires_grad_(False)
        self.settings = settings

    def forward(
        self,
        batch: Batch,
        target_p: torch.Tensor,
        target_in_vocab: torch.Tensor,
        denominators: torch.Tensor | None = None,
        weight_scale: float = 1.0,
    ) -> TTTResult:
        return ttt_forward(
            self.drafter,
            self.embed,
            batch,
            target_p,
            target_in_vocab,
            self.settings,
            denominators,
            weight_scale,
        )


def step_weights(steps: int, decay: float) -> list[float]:
    return [decay**k for k in range(steps)]
