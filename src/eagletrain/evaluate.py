"""Stage 4b, eval: speculative decoding with the *exported* drafter against the target.

Export bugs therefore show up here as a low tau. Greedy speculative output must equal
plain greedy decoding token for token; any difference fails the stage.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import torch

from eagletrain.embedded import embedded_file, is_embedded
from eagletrain.errors import InputError, VerifyError
from eagletrain.export import SGLANG_DIR, load_exported
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
from eagletrain.target import load_target, load_tokenizer, pick_device, resolve_target
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


def run_eval(run: Run, allow_partial: bool = False) -> dict[str, Any]:
    ledger, cfg = run.ledger, run.config
    done = ledger.completion(STAGE)
    if done is not None:
        return done["detail"]
    require_previous(run, STAGE, allow_partial)
    ec = cfg.eval
    device = pick_device(ec.device)
    source = resolve_target(cfg.target)
    tokenizer = load_tokenizer(source)
    model = load_target(source, cfg.target.dtype, device)
    drafter = load_exported(run.dir / "export" / SGLANG_DIR).to(device, model.dtype).eval()
    embed = model.get_input_embeddings()
    eos = (
        {int(model.config.eos_token_id)}
        if isinstance(model.config.eos_token_id, int)
        else set(model.config.eos_token_id or [])
    )
    if tokenizer.eos_token_id is not None:
        eos.add(int(tokenizer.eos_token_id))
    prompts = load_prompts(ec.dataset, ec.num_prompts)
    ledger.begin_stage(STAGE, "units", len(prompts), "prompts")
    eagle = EagleProposer(drafter, embed)
    accepted: list[int] = []
    lookup_accepted: list[int] = []
    plain_s = spec_s = 0.0
    per_prompt = []
    mismatches: list[dict[str, Any]] = []  # divergence from plain greedy: a bug
    ties: list[dict[str, Any]] = []  # divergence at a numerical near-tie of the target
    tolerance = TIE_TOLERANCE[model.dtype]

    def done_prompts(led) -> int:
        return (led.stage_row(STAGE) or {}).get("units_done", 0)

    with (
        WorkerSession(ledger, run.dir, STAGE, "0/1", done_counter=done_prompts) as worker,
        stage_progress() as bar,
    ):
        task = bar.add_task("eval", total=len(prompts), unit="prompts")
        for i, (pid, text) in enumerate(prompts):
            ids = tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
            )
            prompt = tokenizer(ids, add_special_tokens=False)["input_ids"]
            lookup_proposer = PromptLookupProposer(vocab_size=model.config.vocab_size)
            if ec.temperature > 0:
                # sampling is lossless in distribution, not token by token: no equality check
                # here (tests/test_speculative.py checks the distribution statistically)
                gen = torch.Generator().manual_seed(ec.seed * 100_003 + i)
                args = (prompt, ec.max_new_tokens)
                plain = sample_decode(model, *args, eos, ec.temperature, gen)
                spec = speculative_sample(
                    model, eagle, *args, ec.draft_steps, eos, ec.temperature, gen
                )
                lookup = speculative_sample(
                    model, lookup_proposer, *args, ec.draft_steps, eos, ec.temperature, gen
                )
            else:
                plain = greedy_decode(model, prompt, ec.max_new_tokens, eos)
                spec = speculative_greedy(
                    model, eagle, prompt, ec.max_new_tokens, ec.draft_steps, eos
                )
                lookup = speculative_greedy(
                    model, lookup_proposer, prompt, ec.max_new_tokens, ec.draft_steps, eos
                )
            # greedy must reproduce plain greedy decoding token for token
            checks = [] if ec.temperature > 0 else [("eagle", spec), ("prompt-lookup", lookup)]
            for name, decoded in checks:
                at = first_divergence(plain, decoded)
                if at is None:
                    continue
                margin = plain.margins[at] if at < len(plain.margins) else float("inf")
                entry = {"prompt": pid, "proposer": name, "position": at, "plain_margin": margin}
                (ties if margin <= tolerance else mismatches).append(entry)
            lookup_accepted += lookup.accepted_per_cycle
            accepted += spec.accepted_per_cycle
            plain_s += plain.seconds
            spec_s += spec.seconds
            per_prompt.append(
                {
                    "id": pid,
                    "tokens": len(spec.tokens),
                    "tau": pooled_tau(spec.accepted_per_cycle),
                    "plain_s": plain.seconds,
                    "spec_s": spec.seconds,
                }
            )
            ledger.set_units_done(STAGE, i + 1)
            worker.progressed()
            bar.advance(task)
    if mismatches:
        raise VerifyError(
            f"eval: speculative output differs from plain greedy away from any numerical tie "
            f"(not lossless): {mismatches}"
        )
    results = {
        "dataset": ec.dataset,
        "prompts": len(prompts),
        "draft_steps": ec.draft_steps,
        "temperature": ec.temperature,
        "cycles": len(accepted),
        "tau": pooled_tau(accepted),
        "per_position_acceptance": per_position_acceptance(accepted, ec.draft_steps),
        "prompt_lookup_tau": pooled_tau(lookup_accepted),
        "plain_seconds": plain_s,
        "speculative_seconds": spec_s,
        "speedup": plain_s / spec_s if spec_s else None,
        "device": str(device),
        "dtype": str(model.dtype).removeprefix("torch."),
        "lossless": True if ec.temperature == 0 else "by construction (rejection sampling)",
        "tie_tolerance": tolerance,
        "tie_divergences": ties,
        "per_prompt": per_prompt,
    }
    out = run.path("eval", "results.json")
    out.write_text(json.dumps(results, indent=2))
    summary = {k: v for k, v in results.items() if k != "per_prompt"}
    ledger.complete(
        STAGE, len(prompts), sum(p["tokens"] for p in per_prompt), "", allow_partial, summary
    )
    return summary


def describe(results: dict[str, Any]) -> str:
    ppa = ", ".join(f"{a:.2f}" for a in results["per_position_acceptance"])
    mode = (
        f"greedy, lossless ({len(results['tie_divergences'])} divergences at numerical ties, "
        f"{results['dtype']})"
        if results["temperature"] == 0
        else f"sampling at T={results['temperature']:g} (lossless by construction)"
    )
    return (
        f"eval: {results['prompts']} {results['dataset']} prompts, chain "
        f"{results['draft_steps']}, {mode}; per-position acceptance [{ppa}]; prompt-lookup "
        f"tau {results['prompt_lookup_tau']:.3f}; speedup {results['speedup']:.2f}x on "
        f"{results['device']}"
    )
