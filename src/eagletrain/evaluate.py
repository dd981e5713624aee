"""Stage 4b, eval: speculative decoding with the *exported* drafter against the target.

Export bugs therefore show up here as a low tau. Greedy speculative output must equal
plain greedy decoding token for token; any difference fails the stage.
"""

from __future__ import annotations

import gzip
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from eagletrain.drafter import Eagle3Drafter
from eagletrain.embedded import embedded_file, is_embedded
from eagletrain.errors import InputError, VerifyError
from eagletrain.export import SGLANG_DIR, load_exported
from eagletrain.extract import DataSamples
from eagletrain.progress import stage_progress
from eagletrain.rundir import Run, require_previous
from eagletrain.speculative import (
    TIE_TOLERANCE,
    EagleProposer,
    PromptLookupProposer,
    first_divergence,
    greedy_decode,
    per_position_acceptance,
    pooled_tau,
    sample_decode,
    speculative_greedy,
    speculative_sample,
)
from eagletrain.static_draft_cache import StaticDraftCache
from eagletrain.target import load_target, load_tokenizer, pick_device, resolve_target
from eagletrain.target_session import StaticTarget
from eagletrain.tree import TreeShape, speculative_tree
from eagletrain.worker import WorkerSession

STAGE = "eval"


def load_prompts(dataset: str, limit: int) -> list[tuple[str, str]]:
    """(id, first user turn) pairs from MT-bench, HumanEval, or a JSONL with `prompt`/`turns`."""
    path = embedded_file(dataset) if is_embedded(dataset) else Path(dataset)
    if not path.is_file():
        raise InputError(f"{path}: prompts file not found")
    opener = gzip.open if path.suffix == ".gz" else open
    prompts = []
    with opener(path, "rt", encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as err:
                raise InputError(f"{path}:{lineno}: invalid JSON ({err.msg})") from None
            text = obj.get("turns", [None])[0] if "turns" in obj else obj.get("prompt")
            if not isinstance(text, str):
                raise InputError(f"{path}:{lineno}: no prompt text (`turns` or `prompt`)")
            prompts.append((str(obj.get("question_id", obj.get("task_id", lineno))), text))
            if len(prompts) >= limit:
                break
    return prompts


def heldout_prompts(run: Run, limit: int) -> list[tuple[str, list[int]]]:
    """(key, prompt ids) of held-out training conversations: each sample's tokens before
    its first assistant (loss-masked) token, i.e. the history and the generation prompt.
    Read from the data stage: decoding needs tokens only, not extracted hidden states."""
    samples = DataSamples(run)
    keys = [key for key, row in samples.rows.items() if row.split == "heldout"]
    if not keys:
        raise InputError(f"{run.dir}: eval.dataset = 'heldout' but the run has no held-out split")
    prompts = []
    for key in keys[:limit]:
        ids, mask = samples.get(key)
        first = int(mask.nonzero()[0]) if mask.any() else len(ids)
        if first > 0:
            prompts.append((key, ids[:first].tolist()))
    return prompts


def chat_prompts(tokenizer: Any, dataset: str, limit: int) -> list[tuple[str, list[int]]]:
    out = []
    for pid, text in load_prompts(dataset, limit):
        chat = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
        )
        out.append((pid, tokenizer(chat, add_special_tokens=False)["input_ids"]))
    return out


@dataclass
class Decoding:
    """What one evaluation compares, on the same target, cache and dtype."""

    max_new_tokens: int
    draft_steps: int
    temperature: float
    seed: int
    tree: TreeShape | None
    # "eager" (DynamicCache), "static" (one preallocated cache) or "compiled" (static, with
    # torch.compile / CUDA graphs for fixed-shape steps): plain and speculative share it
    engine: str = "eager"


def static_engines(
    model: torch.nn.Module,
    drafter: Eagle3Drafter,
    prompts: list[tuple[str, list[int]]],
    settings: Decoding,
) -> tuple[StaticTarget | None, StaticDraftCache | None]:
    """The target's and the drafter's static caches sized for the longest prompt (None, None
    for the eager engine)."""
    if settings.engine == "eager":
        return None, None
    tree = settings.tree
    verify = max(settings.draft_steps, tree.total_tokens if tree else 0) + 1
    room = max(len(p) for _, p in prompts) + settings.max_new_tokens + verify
    # tree drafting appends up to (depth - 1) x topk nodes after the real prefix
    drafted = (tree.depth - 1) * tree.topk if tree else 0
    compile = settings.engine == "compiled"
    draft_cache = StaticDraftCache(drafter, room + max(drafted, settings.draft_steps), compile)
    # new tokens per cycle: up to k + 1 (chain) or depth + 1 (tree); tree steps are topk wide
    longest_step = max(settings.draft_steps, tree.depth if tree else 0) + 1
    draft_cache.warm_up(range(1, longest_step + 1), [tree.topk] if tree else [])
    return StaticTarget(model, room, compile), draft_cache


def _summary(accepted: list[int], positions: int, plain_s: float, spec_s: float) -> dict:
    return {
        "cycles": len(accepted),
        "tau": pooled_tau(accepted),
        "per_position_acceptance": per_position_acceptance(accepted, positions),
        "speculative_seconds": spec_s,
        "speedup": plain_s / spec_s if spec_s else None,
    }


def _warm_up(
    model: torch.nn.Module,
    eagle: EagleProposer,
    prompt: list[int],
    settings: Decoding,
    eos: set[int],
    engine: StaticTarget | None,
) -> None:
    """Run every method once over the first prompt, untimed, so that no timing includes
    compilation, CUDA-graph capture or first-call library setup (as in a server that has
    warmed up). The compiled engine at full length: 8 tokens left ~7 s of compilation and
    capture in its first timed prompt on the H200; the others compile nothing."""
    k, lookup = settings.draft_steps, PromptLookupProposer(vocab_size=model.config.vocab_size)
    n = settings.max_new_tokens if settings.engine == "compiled" else 8
    greedy_decode(model, prompt, n, eos, engine=engine)
    speculative_greedy(model, eagle, prompt, n, k, eos, engine=engine)
    speculative_greedy(model, lookup, prompt, n, k, eos, engine=engine)
    if settings.tree:
        speculative_tree(model, eagle, prompt, n, settings.tree, eos, engine=engine)


def evaluate_prompts(
    model: torch.nn.Module,
    drafter: Eagle3Drafter,
    prompts: list[tuple[str, list[int]]],
    settings: Decoding,
    eos: set[int],
    on_prompt: Any = None,
    engines: tuple[StaticTarget | None, StaticDraftCache | None] | None = None,
) -> dict[str, Any]:
    """Plain decoding, EAGLE chain, EAGLE dynamic tree and prompt lookup on every prompt;
    greedy outputs must equal plain greedy decoding (up to numerical near-ties). `engines`:
    static engines made by `static_engines` for several evaluations (compiled graphs are
    then built once), else made here for these prompts."""
    engine, draft_cache = engines or static_engines(model, drafter, prompts, settings)
    eagle = EagleProposer(drafter, model.get_input_embeddings(), draft_cache)
    names = ["eagle", "prompt-lookup", *(["tree"] if settings.tree else [])]
    accepted: dict[str, list[int]] = {n: [] for n in names}
    seconds: dict[str, float] = {n: 0.0 for n in ["plain", *names]}
    per_prompt, mismatches, ties = [], [], []
    tolerance = TIE_TOLERANCE[model.dtype]
    k, temp, max_new = settings.draft_steps, settings.temperature, settings.max_new_tokens
    on = {"engine": engine}
    _warm_up(model, eagle, prompts[0][1], settings, eos, engine)
    for i, (pid, prompt) in enumerate(prompts):
        lookup_proposer = PromptLookupProposer(vocab_size=model.config.vocab_size)
        decoded = {}
        if temp > 0:
            # sampling is lossless in distribution, not token by token: no equality check
            # here (tests/test_speculative.py, test_tree.py check it statistically)
            gen = torch.Generator().manual_seed(settings.seed * 100_003 + i)
            plain = sample_decode(model, prompt, max_new, eos, temp, gen, **on)
            decoded["eagle"] = speculative_sample(
                model, eagle, prompt, max_new, k, eos, temp, gen, **on
            )
            decoded["prompt-lookup"] = speculative_sample(
                model, lookup_proposer, prompt, max_new, k, eos, temp, gen, **on
            )
        else:
            plain = greedy_decode(model, prompt, max_new, eos, **on)
            decoded["eagle"] = speculative_greedy(model, eagle, prompt, max_new, k, eos, **on)
            decoded["prompt-lookup"] = speculative_greedy(
                model, lookup_proposer, prompt, max_new, k, eos, **on
            )
        if settings.tree:
            gen = torch.Generator().manual_seed(settings.seed * 100_003 + i + 7)
            decoded["tree"] = speculative_tree(
                model, eagle, prompt, max_new, settings.tree, eos, temp, gen, **on
            )
        for name, result in decoded.items() if temp == 0 else ():
            at = first_divergence(plain, result)
            if at is None:
                continue
            margin = plain.margins[at] if at < len(plain.margins) else float("inf")
            entry = {"prompt": pid, "proposer": name, "position": at, "plain_margin": margin}
            (ties if margin <= tolerance else mismatches).append(entry)
        seconds["plain"] += plain.seconds
        for name, result in decoded.items():
            accepted[name] += result.accepted_per_cycle
            seconds[name] += result.seconds
        per_prompt.append(
            {
                "id": pid,
                "tokens": len(decoded["eagle"].tokens),
                "plain_tokens": len(plain.tokens),
                "tau": pooled_tau(decoded["eagle"].accepted_per_cycle),
                "plain_s": plain.seconds,
                "spec_s": decoded["eagle"].seconds,
                **(
                    {"tree_tau": pooled_tau(decoded["tree"].accepted_per_cycle)}
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
    chain = _summary(accepted["eagle"], k, seconds["plain"], seconds["eagle"])
    results = {
        "prompts": len(prompts),
        "draft_steps": k,
        "temperature": temp,
        **chain,
        "prompt_lookup_tau": pooled_tau(accepted["prompt-lookup"]),
        "plain_seconds": seconds["plain"],
        "dtype": str(model.dtype).removeprefix("torch."),
        "engine": settings.engine,
        "lossless": True if temp == 0 else "by construction (rejection sampling)",
        "tie_tolerance": tolerance,
        "tie_divergences": ties,
        "per_prompt": per_prompt,
    }
    if settings.tree:
        results["tree"] = {
            **_summary(accepted["tree"], settings.tree.depth, seconds["plain"], seconds["tree"]),
            **asdict(settings.tree),
        }
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
    run: Run, dtype: str | None = None, device: str = "auto", model: str | None = None
) -> DecodingParts:
    """The run's target (or `model` instead) in `dtype` (default the run's) and the drafter
    its export directory holds, frozen, in the target's dtype."""
    target_cfg = run.config.target
    if model:
        target_cfg = target_cfg.model_copy(update={"model": model})
    source = resolve_target(target_cfg)
    where = pick_device(device)
    target = load_target(source, dtype or target_cfg.dtype, where).eval()
    tokenizer = load_tokenizer(source)
    drafter = load_exported(run.dir / "export" / SGLANG_DIR)
    drafter = drafter.to(where, target.dtype).eval().requires_grad_(False)
    return DecodingParts(target, tokenizer, drafter, where, target_eos(target, tokenizer))


def dataset_prompts(
    run: Run, tokenizer: Any, dataset: str, limit: int
) -> list[tuple[str, list[int]]]:
    """Prompt ids of "heldout" (the run's held-out conversations) or a prompt dataset."""
    if dataset == "heldout":
        return heldout_prompts(run, limit)
    return chat_prompts(tokenizer, dataset, limit)


def run_eval(run: Run, allow_partial: bool = False) -> dict[str, Any]:
    ledger, cfg = run.ledger, run.config
    done = ledger.completion(STAGE)
    if done is not None:
        return done["detail"]
    require_previous(run, STAGE, allow_partial)
    ec = cfg.eval
    parts = load_for_decoding(run, cfg.target.dtype, ec.device)
    model, drafter, device, eos = parts.model, parts.drafter, parts.device, parts.eos
    prompts = dataset_prompts(run, parts.tokenizer, ec.dataset, ec.num_prompts)
    settings = Decoding(
        ec.max_new_tokens,
        ec.draft_steps,
        ec.temperature,
        ec.seed,
        TreeShape(ec.tree_total_tokens, ec.tree_depth, ec.tree_topk) if ec.tree else None,
        ec.engine,
    )
    ledger.begin_stage(STAGE, "units", len(prompts), "prompts")

    def done_prompts(led) -> int:
        return (led.stage_row(STAGE) or {}).get("units_done", 0)

    with (
        WorkerSession(ledger, run.dir, STAGE, "0/1", done_counter=done_prompts) as worker,
        stage_progress() as bar,
    ):
        task = bar.add_task("eval", total=len(prompts), unit="prompts")

        def on_prompt(n: int) -> None:
            ledger.set_units_done(STAGE, n)
            worker.progressed()
            bar.update(task, completed=n)

        results = evaluate_prompts(model, drafter, prompts, settings, eos, on_prompt)
    results = {"dataset": ec.dataset, "device": str(device), **results}
    out = run.path("eval", "results.json")
    out.write_text(json.dumps(results, indent=2))
    summary = {k: v for k, v in results.items() if k != "per_prompt"}
    ledger.complete(
        STAGE,
        len(prompts),
        sum(p["tokens"] for p in results["per_prompt"]),
        "",
        allow_partial,
        summary,
    )
    return summary


def target_eos(model: torch.nn.Module, tokenizer: Any) -> set[int]:
    eos_id = model.config.eos_token_id
    eos = {int(eos_id)} if isinstance(eos_id, int) else set(eos_id or [])
    if tokenizer.eos_token_id is not None:
        eos.add(int(tokenizer.eos_token_id))
    return eos


def describe(results: dict[str, Any]) -> str:
    ppa = ", ".join(f"{a:.2f}" for a in results["per_position_acceptance"])
    mode = (
        f"greedy, lossless ({len(results['tie_divergences'])} divergences at numerical ties, "
        f"{results['dtype']})"
        if results["temperature"] == 0
        else f"sampling at T={results['temperature']:g} (lossless by construction)"
    )
    tree = results.get("tree")
    tree_text = (
        f"; dynamic tree ({tree['total_tokens']} tokens, depth {tree['depth']}, "
        f"top-{tree['topk']}) tau {tree['tau']:.3f}, speedup {tree['speedup']:.2f}x"
        if tree
        else ""
    )
    return (
        f"eval: {results['prompts']} {results['dataset']} prompts, chain "
        f"{results['draft_steps']}, {mode}; per-position acceptance [{ppa}]; prompt-lookup "
        f"tau {results['prompt_lookup_tau']:.3f}; speedup {results['speedup']:.2f}x on "
        f"{results['device']}{tree_text}"
    )
