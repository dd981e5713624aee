"""Evaluation with the target in this process: plain decoding, the EAGLE chain, the EAGLE
dynamic tree and prompt lookup on every prompt, all on one decoding engine, with the
*exported* drafter (export bugs show up as a low tau). Greedy speculative output must equal
plain greedy decoding, up to numerical near-ties."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

from eagletrain.decode import cpu_linears
from eagletrain.decode.acceptance import (
    out_of_vocab_share,
    per_position_acceptance,
    pooled_tau,
    tau_interval,
    tokens_and_cycles,
)
from eagletrain.decode.chain import (
    TIE_TOLERANCE,
    Decoded,
    first_divergence,
    plain_decode,
    speculative_chain,
)
from eagletrain.decode.engine import DecodingEngine, EngineKind
from eagletrain.decode.proposers import PromptLookupProposer
from eagletrain.decode.tree import TreeShape, speculative_tree
from eagletrain.drafter import Eagle3Drafter
from eagletrain.errors import VerifyError
from eagletrain.export import SGLANG_DIR, load_exported
from eagletrain.runtime.rundir import Run
from eagletrain.target import (
    load_target,
    load_tokenizer,
    pick_device,
    resolve_target,
    target_eos,
)


@dataclass
class Decoding:
    """What one evaluation compares, on the same target, cache and dtype."""

    max_new_tokens: int
    draft_steps: int
    temperature: float
    seed: int
    tree: TreeShape | None
    engine: EngineKind = "eager"


def sized_engine(
    model: torch.nn.Module,
    drafter: Eagle3Drafter,
    prompts: list[tuple[str, list[int]]],
    settings: Decoding,
) -> DecodingEngine:
    """The engine `settings` name, its caches sized for the longest of `prompts`."""
    tree = settings.tree
    return DecodingEngine.sized(
        model,
        settings.engine,
        drafter,
        max(len(p) for _, p in prompts),
        settings.max_new_tokens,
        settings.draft_steps,
        (tree.total_tokens, tree.depth, tree.topk) if tree else None,
    )


def _warm_up(engine: DecodingEngine, drafter: Eagle3Drafter, prompt: list[int], s: Decoding):
    """Every method once over the first prompt, untimed, so that no timing includes
    compilation, CUDA-graph capture or first-call library setup (as in a server that has
    warmed up). The compiled engine at full length: 8 tokens left ~7 s of compilation and
    capture in its first timed prompt on the H200; the others compile nothing."""
    n = s.max_new_tokens if s.engine == "compiled" else 8
    lookup = PromptLookupProposer(vocab_size=engine.model.config.vocab_size)
    plain_decode(engine, prompt, n, set())
    speculative_chain(engine, engine.eagle(drafter), prompt, n, s.draft_steps, set())
    speculative_chain(engine, lookup, prompt, n, s.draft_steps, set())
    if s.tree:
        speculative_tree(engine, engine.eagle(drafter), prompt, n, s.tree, set())


def _summary(runs: list[Decoded], positions: int, plain_s: float, in_vocab: Any) -> dict[str, Any]:
    """Pooled tau with its bootstrap interval over prompts, per-position acceptance, the
    out-of-vocabulary share of cycles and the speedup over plain decoding."""
    accepted = [a for r in runs for a in r.accepted_per_cycle]
    bonus = [t for r in runs for t in r.bonus_tokens]
    seconds = sum(r.seconds for r in runs)
    low, high = tau_interval([tokens_and_cycles(r.accepted_per_cycle) for r in runs])
    return {
        "cycles": len(accepted),
        "tau": pooled_tau(accepted),
        "tau_ci95": [low, high],
        "per_position_acceptance": per_position_acceptance(accepted, positions),
        "out_of_vocab_share": out_of_vocab_share(accepted, bonus, in_vocab, positions),
        "speculative_seconds": seconds,
        "speedup": plain_s / seconds if seconds else None,
    }


def evaluate_prompts(
    model: torch.nn.Module,
    drafter: Eagle3Drafter,
    prompts: list[tuple[str, list[int]]],
    settings: Decoding,
    eos: set[int],
    on_prompt: Any = None,
    engine: DecodingEngine | None = None,
) -> dict[str, Any]:
    """Plain decoding, EAGLE chain, EAGLE dynamic tree and prompt lookup on every prompt.
    `engine`: one built by `sized_engine` for several evaluations (compiled graphs are
    then built once), else one is made here for these prompts."""
    engine = engine or sized_engine(model, drafter, prompts, settings)
    names = ["eagle", "prompt-lookup", *(["tree"] if settings.tree else [])]
    runs: dict[str, list[Decoded]] = {n: [] for n in names}
    plain_s, per_prompt, mismatches, ties = 0.0, [], [], []
    tolerance = TIE_TOLERANCE[model.dtype]
    k, temp, max_new = settings.draft_steps, settings.temperature, settings.max_new_tokens
    t2d = drafter.t2d.cpu()
    _warm_up(engine, drafter, prompts[0][1], settings)
    for i, (pid, prompt) in enumerate(prompts):
        # sampling is lossless in distribution, not token by token: no equality check then
        # (tests/decode check it statistically)
        gen = torch.Generator().manual_seed(settings.seed * 100_003 + i)
        plain = plain_decode(engine, prompt, max_new, eos, temp, gen)
        lookup = PromptLookupProposer(vocab_size=model.config.vocab_size)
        decoded = {
            "eagle": speculative_chain(engine, engine.eagle(drafter), prompt, max_new, k, eos,
                                       temp, gen),
            "prompt-lookup": speculative_chain(engine, lookup, prompt, max_new, k, eos, temp, gen),
        }  # fmt: skip
        if settings.tree:
            gen = torch.Generator().manual_seed(settings.seed * 100_003 + i + 7)
            decoded["tree"] = speculative_tree(
                engine, engine.eagle(drafter), prompt, max_new, settings.tree, eos, temp, gen
            )
        for name, result in decoded.items() if temp == 0 else ():
            at = first_divergence(plain, result)
            if at is None:
                continue
            margin = plain.margins[at] if at < len(plain.margins) else float("inf")
            entry = {"prompt": pid, "proposer": name, "position": at, "plain_margin": margin}
            (ties if margin <= tolerance else mismatches).append(entry)
        plain_s += plain.seconds
        for name, result in decoded.items():
            runs[name].append(result)
        per_prompt.append(
            {
                "id": pid,
                "tokens": len(decoded["eagle"].tokens),
                "plain_tokens": len(plain.tokens),
                "tau": pooled_tau(decoded["eagle"].accepted_per_cycle),
                "cycles": len(decoded["eagle"].accepted_per_cycle),
                "plain_s": plain.seconds,
                "spec_s": decoded["eagle"].seconds,
                **(
                    {
                        "tree_tau": pooled_tau(decoded["tree"].accepted_per_cycle),
                        "tree_cycles": len(decoded["tree"].accepted_per_cycle),
                    }
                    if settings.tree
                    else {}
                ),
            }
        )
        if on_prompt:
            on_prompt(i + 1)
    if mismatches:
        raise VerifyError(
            f"eval: speculative output differs from plain greedy away from any numerical tie "
            f"(not lossless): {mismatches}"
        )

    def in_vocab(token: int) -> bool:
        return bool(t2d[token])

    results = {
        "prompts": len(prompts),
        "draft_steps": k,
        "temperature": temp,
        **_summary(runs["eagle"], k, plain_s, in_vocab),
        "prompt_lookup_tau": pooled_tau([a for r in runs["prompt-lookup"]
                                         for a in r.accepted_per_cycle]),
        "plain_seconds": plain_s,
        "plain_tokens_per_s": sum(p["plain_tokens"] for p in per_prompt) / plain_s,
        "dtype": str(model.dtype).removeprefix("torch."),
        "engine": settings.engine,
        "lossless": True if temp == 0 else "by construction (rejection sampling)",
        "tie_tolerance": tolerance,
        "tie_divergences": ties,
        "per_prompt": per_prompt,
    }  # fmt: skip
    if settings.tree:
        tree = _summary(runs["tree"], settings.tree.depth, plain_s, in_vocab)
        results["tree"] = {**tree, **asdict(settings.tree)}
    return results


@dataclass
class DecodingParts:
    """A run's target and exported drafter, loaded for decoding on one device."""

    model: torch.nn.Module
    tokenizer: Any
    drafter: Eagle3Drafter
    device: torch.device
    eos: set[int]


def load_for_decoding(
    run: Run,
    dtype: str | None = None,
    device: str = "auto",
    model: str | None = None,
    prepack: bool = False,
) -> DecodingParts:
    """The run's target (or `model` instead) in `dtype` (default the run's) and the drafter
    its export directory holds, frozen, in the target's dtype; with `prepack` on a CPU in
    float32, both with oneDNN-prepacked linear layers."""
    target_cfg = run.config.target
    if model:
        target_cfg = target_cfg.model_copy(update={"model": model})
    source = resolve_target(target_cfg)
    where = pick_device(device)
    target = load_target(source, dtype or target_cfg.dtype, where).eval()
    tokenizer = load_tokenizer(source)
    drafter = load_exported(run.dir / "export" / SGLANG_DIR)
    drafter = drafter.to(where, target.dtype).eval().requires_grad_(False)
    eos = target_eos(target, tokenizer)
    if prepack and cpu_linears.usable(where, target.dtype):
        cpu_linears.prepack_linears(target)
        cpu_linears.prepack_linears(drafter)
    return DecodingParts(target, tokenizer, drafter, where, eos)
