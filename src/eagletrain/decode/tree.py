"""EAGLE-2/3 dynamic-tree speculative decoding in plain PyTorch.

Drafting: the root's top-k next tokens are depth 1; at each further depth the drafter runs
once on the `topk` best nodes of the previous depth (by cumulative draft log-probability),
each attending to the real prefix and its own ancestors, and each proposes its top-k
children. The `total_tokens` best nodes of all depths form the tree (a child never scores
above its parent, so the set holds every chosen node's ancestors).

Verification: the target scores [last token, tree nodes] in one forward with a tree
attention mask and positions (last position + depth). From the root, greedy decoding
moves to the child equal to the target's argmax; sampling tries the siblings in turn,
accepting child c with probability r(c) / sum(r), where r is the target's distribution with
the siblings already rejected removed (rejection sampling with one-hot proposals, so the
output is distributed exactly as the target's). Where no child is taken, the target's own
token (argmax, or a sample from r) is the bonus. The target's and the drafter's caches
then keep the accepted path only.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from eagletrain.decode.chain import Decoded, sample_token, truncate_at_eos
from eagletrain.decode.engine import DecodingEngine
from eagletrain.decode.proposers import EagleProposer


@dataclass(frozen=True)
class TreeShape:
    total_tokens: int = 32  # draft tokens the target verifies per cycle
    depth: int = 6
    topk: int = 8


@dataclass
class DraftTree:
    """Nodes in breadth-first order; parents[i] is a node index or -1 (the root: the last
    real token). Row 0 of a verification forward is the root, node i is row i + 1."""

    tokens: list[int]
    parents: list[int]
    depths: list[int]
    scores: list[float]  # cumulative draft log-probability

    def children(self, node: int) -> list[int]:
        return [i for i, p in enumerate(self.parents) if p == node]

    def mask(self) -> torch.Tensor:
        """[n + 1, n + 1] bool: row r sees itself, its ancestors and the root."""
        n = len(self.tokens)
        allowed = torch.zeros(n + 1, n + 1, dtype=torch.bool)
        allowed[:, 0] = True
        for i in range(n):
            node = i
            while node != -1:
                allowed[i + 1, node + 1] = True
                node = self.parents[node]
        return allowed


@dataclass
class _Candidate:
    score: float  # cumulative draft log-probability
    depth: int
    token: int
    parent: int  # candidate index, -1 for the root


@torch.inference_mode()
def draft_tree(proposer: EagleProposer, shape: TreeShape) -> DraftTree:
    drafter, device = proposer.drafter, proposer.device
    real = proposer.real  # the drafter cache holds the real prefix; tree entries go after it

    def expand(hidden: torch.Tensor, parents: list[int], depth: int) -> list[int]:
        """Each parent's top-k children from the drafter's outputs at the parents ([F, H]),
        in one batched top-k and one read to the host; their candidate indices."""
        logits = drafter.logits(hidden)
        logp = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), -1)
        values, ids = logp.topk(min(shape.topk, logp.shape[-1]))
        values, tokens = values.tolist(), drafter.draft_to_target(ids).tolist()
        first = len(candidates)
        for parent, row_values, row_tokens in zip(parents, values, tokens, strict=True):
            base = candidates[parent].score if parent != -1 else 0.0
            candidates.extend(
                _Candidate(base + v, depth, t, parent)
                for v, t in zip(row_values, row_tokens, strict=True)
            )
        return list(range(first, len(candidates)))

    candidates: list[_Candidate] = []
    frontier = expand(proposer.last_hidden[0, -1:], [-1], 1)
    output: dict[int, torch.Tensor] = {}  # candidate -> the drafter's output at that node
    slot: dict[int, int] = {}  # candidate -> its entry in the drafter cache
    for depth in range(2, shape.depth + 1):
        start = len(proposer.cache)
        allowed = torch.zeros(len(frontier), start + len(frontier), dtype=torch.bool)
        allowed[:, :real] = True
        for row, c in enumerate(frontier):
            slot[c] = start + row
            node = c
            while node != -1:
                if node in slot:
                    allowed[row, slot[node]] = True
                node = candidates[node].parent
        hidden_in = torch.cat(
            [
                proposer.last_hidden if candidates[c].parent == -1 else output[candidates[c].parent]
                for c in frontier
            ],
            dim=1,
        )
        ids = torch.tensor([[candidates[c].token for c in frontier]], device=device)
        positions = torch.tensor(
            [[real + candidates[c].depth - 1 for c in frontier]], device=device
        )
        out = proposer.step(hidden_in, proposer.embed(ids), positions, allowed.to(device))
        for row, c in enumerate(frontier):
            output[c] = out[:, row : row + 1]
        children = expand(out[0], frontier, depth)
        frontier = sorted(children, key=lambda i: -candidates[i].score)[: shape.topk]

    chosen = sorted(
        range(len(candidates)), key=lambda i: (-candidates[i].score, candidates[i].depth)
    )[: shape.total_tokens]
    chosen_set = set(chosen)
    for c in chosen:  # holds by construction; a broken invariant must not pass silently
        assert candidates[c].parent == -1 or candidates[c].parent in chosen_set
    order = sorted(chosen, key=lambda i: (candidates[i].depth, -candidates[i].score))
    index = {c: i for i, c in enumerate(order)}
    return DraftTree(
        [candidates[c].token for c in order],
        [index[candidates[c].parent] if candidates[c].parent != -1 else -1 for c in order],
        [candidates[c].depth for c in order],
        [candidates[c].score for c in order],
    )


def verify_greedy(tree: DraftTree, logits: torch.Tensor) -> tuple[list[int], int]:
    """(accepted node path, the target's next token)."""
    predicted = logits.argmax(-1).tolist()  # one read to the host for the whole walk
    path, node = [], -1
    while True:
        token = predicted[node + 1]
        nxt = next((c for c in tree.children(node) if tree.tokens[c] == token), None)
        if nxt is None:
            return path, token
        path.append(nxt)
        node = nxt


def verify_sampled(
    tree: DraftTree, logits: torch.Tensor, temperature: float, generator: torch.Generator
) -> tuple[list[int], int]:
    path, node = [], -1
    while True:
        residual = torch.softmax(logits[node + 1].double().cpu() / temperature, -1)
        nxt = None
        for c in tree.children(node):
            token = tree.tokens[c]
            u = float(torch.rand((), generator=generator, dtype=torch.float64))
            if u < float(residual[token] / residual.sum()):
                nxt = c
                break
            residual[token] = 0.0
        if nxt is None:
            return path, sample_token(residual / residual.sum(), generator)
        path.append(nxt)
        node = nxt


@torch.inference_mode()
def speculative_tree(
    engine: DecodingEngine,
    proposer: EagleProposer,
    prompt: list[int],
    max_new: int,
    shape: TreeShape,
    eos: set[int],
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
    drafting: Callable[[Any, TreeShape], DraftTree] = draft_tree,
) -> Decoded:
    """Dynamic-tree speculative decoding; greedy at temperature 0, else lossless sampling.
    accepted_per_cycle counts the draft tokens accepted per cycle (tau adds the bonus)."""
    start = time.perf_counter()
    target = engine.session(proposer.aux_layer_ids)
    logits, features = target.forward(prompt)

    def pick(row: torch.Tensor) -> int:
        if temperature == 0:
            return int(row.argmax())
        return sample_token(torch.softmax(row.double().cpu() / temperature, -1), generator)

    out = [pick(logits[-1])]
    proposer.start(prompt, out[0], features)
    accepted_per_cycle, bonus = [], []
    while len(out) < max_new and out[-1] not in eos:
        verified = len(prompt) + len(out) - 1  # target cache length before this cycle
        tree = drafting(proposer, shape)
        positions = [verified + d for d in [0, *tree.depths]]
        logits, features = target.forward_tree([out[-1], *tree.tokens], positions, tree.mask())
        if temperature == 0:
            path, token = verify_greedy(tree, logits)
        else:
            path, token = verify_sampled(tree, logits, temperature, generator)
        rows = [0, *(n + 1 for n in path)]
        target.keep(verified, rows)
        new_tokens = [*(tree.tokens[n] for n in path), token]
        proposer.advance(new_tokens, None if features is None else features[rows])
        accepted_per_cycle.append(len(path))
        bonus.append(token)
        out.extend(new_tokens)
    tokens = truncate_at_eos(out, max_new, eos)
    return Decoded(tokens, time.perf_counter() - start, accepted_per_cycle, [], bonus)
