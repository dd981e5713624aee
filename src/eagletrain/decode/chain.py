"""Chain speculative decoding in plain PyTorch, with a pluggable proposer.

One cycle: the proposer drafts k tokens; the target scores [last token, drafts] in one
forward; drafts are accepted while they agree with the target, then the target adds one
token of its own (the bonus). Greedy (T = 0): accept the longest draft prefix equal to the
target's argmax, then its next argmax. Sampling (T > 0; Leviathan et al., Chen et al.):
draft j is accepted with probability min(1, p(d)/q(d)); the first rejected position is
resampled from norm(max(0, p - q)); if all k are accepted the bonus comes from p, so the
output is distributed exactly as plain sampling from the target. The target's cache is
cropped to what was accepted, and the proposer is told which tokens (and target features)
became real. Tokens per cycle = accepted + 1.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from eagletrain.decode.engine import DecodingEngine
from eagletrain.decode.proposers import Proposer


@dataclass
class Decoded:
    tokens: list[int]
    seconds: float
    accepted_per_cycle: list[int] = field(default_factory=list)
    # plain greedy decoding only: top-1 minus top-2 logit at each step (how near a tie)
    margins: list[float] = field(default_factory=list)
    # speculative decoding: the target's own token that ended each cycle (the bonus)
    bonus_tokens: list[int] = field(default_factory=list)


def _margin(logits: torch.Tensor) -> float:
    top = logits.float().topk(2).values
    return float(top[0] - top[1])


def truncate_at_eos(tokens: list[int], max_new: int, eos: set[int]) -> list[int]:
    tokens = tokens[:max_new]
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1]
    return tokens


# Largest top-2 logit margin still treated as a numerical tie. Greedy speculative decoding
# is exact in exact arithmetic; in low precision, scoring k+1 tokens in one forward rounds
# differently from one-at-a-time decoding, so a near-tie can flip (seen on the H200 in bf16).
TIE_TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-3, torch.bfloat16: 0.5, torch.float16: 0.1}


def first_divergence(plain: Decoded, other: Decoded) -> int | None:
    for i, (a, b) in enumerate(zip(plain.tokens, other.tokens, strict=False)):
        if a != b:
            return i
    if len(plain.tokens) != len(other.tokens):
        return min(len(plain.tokens), len(other.tokens))
    return None


def sample_token(probs: torch.Tensor, generator: torch.Generator) -> int:
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))


def _pick(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> int:
    """The target's next token: its argmax, or a sample at `temperature`."""
    if temperature == 0:
        return int(logits.argmax())
    return sample_token(torch.softmax(logits.double() / temperature, -1), generator)


@torch.inference_mode()
def plain_decode(
    engine: DecodingEngine,
    prompt: list[int],
    max_new: int,
    eos: set[int],
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
) -> Decoded:
    """Plain decoding on `engine` (greedy at T = 0, else sampling): the baseline of every
    speedup, on the same cache and dtype as the speculative loops."""
    start = time.perf_counter()
    target = engine.session(None)
    logits, _ = target.forward(prompt)
    out, margins = [_pick(logits[-1], temperature, generator)], []
    while True:
        if temperature == 0:
            margins.append(_margin(logits[-1]))
        if len(out) >= max_new or out[-1] in eos:
            break
        logits, _ = target.forward(out[-1:])
        out.append(_pick(logits[-1], temperature, generator))
    return Decoded(truncate_at_eos(out, max_new, eos), time.perf_counter() - start, [], margins)


def _verify_greedy(drafts: list[int], logits: torch.Tensor) -> tuple[int, int]:
    predicted = logits.argmax(-1).tolist()
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == predicted[accepted]:
        accepted += 1
    return accepted, predicted[accepted]


def _verify_sampled(
    drafts: list[int],
    q: torch.Tensor,
    logits: torch.Tensor,
    temperature: float,
    generator: torch.Generator,
) -> tuple[int, int]:
    p = torch.softmax(logits.double().cpu() / temperature, -1)
    for j, d in enumerate(drafts):
        u = float(torch.rand((), generator=generator, dtype=torch.float64))
        if u >= min(1.0, float(p[j, d] / q[j, d])):
            residual = (p[j] - q[j]).clamp(min=0)
            total = residual.sum()
            return j, sample_token(residual / total if total > 0 else p[j], generator)
    return len(drafts), sample_token(p[len(drafts)], generator)


@torch.inference_mode()
def speculative_chain(
    engine: DecodingEngine,
    proposer: Proposer,
    prompt: list[int],
    max_new: int,
    k: int,
    eos: set[int],
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
) -> Decoded:
    """Chain speculative decoding of k drafts a cycle: greedy (exact) at T = 0, else
    lossless speculative sampling. accepted_per_cycle counts the drafts accepted."""
    start = time.perf_counter()
    target = engine.session(proposer.aux_layer_ids)
    logits, features = target.forward(prompt)
    out = [_pick(logits[-1], temperature, generator)]
    proposer.start(prompt, out[0], features)
    accepted_per_cycle, bonus = [], []
    while len(out) < max_new and out[-1] not in eos:
        verified = len(prompt) + len(out) - 1  # target cache length before this cycle
        if temperature == 0:
            drafts = proposer.propose(k)
            logits, features = target.forward([out[-1], *drafts])
            accepted, token = _verify_greedy(drafts, logits)
        else:
            drafts, q = proposer.propose_sampled(k, temperature, generator)
            logits, features = target.forward([out[-1], *drafts])
            accepted, token = _verify_sampled(drafts, q, logits, temperature, generator)
        new_tokens = [*drafts[:accepted], token]
        accepted_per_cycle.append(accepted)
        bonus.append(token)
        target.crop(verified + 1 + accepted)
        proposer.advance(new_tokens, None if features is None else features[: accepted + 1])
        out.extend(new_tokens)
    tokens = truncate_at_eos(out, max_new, eos)
    return Decoded(tokens, time.perf_counter() - start, accepted_per_cycle, [], bonus)
