"""Does a system header, or the opening words of the user turn, steer what the target
asks? Prompts the target writes itself under one kind per MT-bench category: a system
header naming the category (`--lever headers`, `data.prompts.system_prompts`) or the
first words of a request of that category (`--lever openings`, `data.prompts.openings`),
with the data stage's own local writer; each request judged by the MT-bench category of
its nearest MT-bench turn-1 prompt in the target's own representation (mean of the last
hidden state over the text, cosine). An opening is part of the request judged: it forces
the kind of request by construction, so its figure says how far the rest follows.

Prints, per kind: the requests written, those the data stage would keep (neither
degenerate nor a duplicate of one kept before it, dedupe.py; the mix's kinds share one
stage), the duplicates among them, and the share of kept ones nearest each MT-bench
category; then two examples each. The headline is the mean share of a kind's requests
nearest its own category, against the template's default header's (no opening) share of
that category, printed last as `steered_share=<value>`, with the difference's 95%
bootstrap interval (requests resampled within each kind).

    python bench/self_prompt_mix.py [--lever headers|openings] [--per-prompt 16]
        [--config configs/smollm2-scale.toml]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from eagletrain.config import load_config
from eagletrain.data.dedupe import Deduplicator, degenerate
from eagletrain.data.self_prompts import local_writer
from eagletrain.embedded import embedded_file
from eagletrain.target import load_target, load_tokenizer, pick_device, resolve_target, target_eos

# one kind per MT-bench category: a system header naming it, and the opening words of a
# request of that kind (neither copies an MT-bench prompt)
CATEGORY_HEADERS = {
    "writing": "You are a helpful AI assistant. People come to you for help with writing: "
    "stories, poems, essays, emails and blog posts.",
    "roleplay": "You are a helpful AI assistant. People ask you to take part in roleplay, "
    "playing the characters and personas they describe.",
    "reasoning": "You are a helpful AI assistant. People bring you puzzles and logic "
    "questions that need careful reasoning.",
    "math": "You are a helpful AI assistant. People ask you math questions: arithmetic, "
    "algebra, geometry and probability problems to solve.",
    "coding": "You are a helpful AI assistant. People ask you for help with coding: programs "
    "in Python, C++, JavaScript and SQL to create, explain or fix.",
    "extraction": "You are a helpful AI assistant. People give you texts and ask for the "
    "extraction of names, dates, numbers and facts, often as JSON.",
    "stem": "You are a helpful AI assistant. People ask you STEM questions about physics, "
    "chemistry, biology and engineering.",
    "humanities": "You are a helpful AI assistant. People ask you about the humanities: "
    "history, philosophy, economics, law and the arts.",
}
CATEGORY_OPENINGS = {
    "writing": "Write a short story",
    "roleplay": "Pretend you are",
    "reasoning": "Here is a logic puzzle:",
    "math": "Solve this math problem:",
    "coding": "Write a Python function",
    "extraction": "From the following text, extract",
    "stem": "In physics, explain",
    "humanities": "Discuss the history of",
}


def mtbench() -> list[tuple[str, str]]:
    """(category, turn-1 text) of the packaged MT-bench."""
    with embedded_file("mtbench").open(encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [(r["category"], r["turns"][0]) for r in rows]


@torch.inference_mode()
def embed(model, tokenizer, texts: list[str]) -> torch.Tensor:
    """Unit-norm mean of the final hidden state over each text's tokens."""
    out = []
    for text in texts:
        ids = tokenizer(text, return_tensors="pt", truncation=True, max_length=256)["input_ids"]
        hidden = model.model(ids.to(model.device)).last_hidden_state[0].float().mean(0)
        out.append(hidden / hidden.norm())
    return torch.stack(out)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default="configs/smollm2-scale.toml")
    parser.add_argument("--lever", choices=["headers", "openings"], default="headers")
    parser.add_argument("--per-prompt", type=int, default=16, help="requests per kind")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()

    config = load_config(Path(args.config))
    cfg = config.data.prompts
    kinds = CATEGORY_HEADERS if args.lever == "headers" else CATEGORY_OPENINGS
    names = [None, *kinds]  # None: the template's default header, no opening
    device = pick_device(args.device)
    source = resolve_target(config.target)
    tokenizer = load_tokenizer(source)
    model = load_target(source, args.dtype, device).eval()
    eos = target_eos(model, tokenizer)
    # the default, then the mix (slot s of kind s % n): the data stage's writer
    alone = config.model_copy(deep=True)
    alone.data.prompts.system_prompt, alone.data.prompts.system_prompts = None, []
    alone.data.prompts.openings = []
    mixed = alone.model_copy(deep=True)
    if args.lever == "headers":
        mixed.data.prompts.system_prompts = list(kinds.values())
    else:
        mixed.data.prompts.openings = list(kinds.values())
    # one batch each: as many decoder rows as requests (the config's may be thousands)
    alone.data.prompts.batch_size = args.per_prompt
    mixed.data.prompts.batch_size = args.per_prompt * len(kinds)
    by_kind: dict[str | None, list[tuple[str, int, bool]]] = {
        None: local_writer(model, tokenizer, alone, eos)([(s, 0) for s in range(args.per_prompt)])
    }
    written = local_writer(model, tokenizer, mixed, eos)(
        [(s, 0) for s in range(args.per_prompt * len(kinds))]
    )
    for i, category in enumerate(kinds):
        by_kind[category] = written[i :: len(kinds)]

    # each request's fate as the stage decides it: degenerate, else a duplicate of one kept
    # before it (the mix's kinds share one stage, in slot order), else kept (None)
    fates: dict[str | None, list[str | None]] = {name: [] for name in names}
    alone_seen, mixed_seen = Deduplicator(cfg.near_duplicate), Deduplicator(cfg.near_duplicate)
    for slot, (text, _, ok) in enumerate(by_kind[None]):
        least = alone.data.prompts.min_words_of(slot)
        fates[None].append(degenerate(text, ok, least) or alone_seen.duplicate(text))
    for slot, (text, _, ok) in enumerate(written):
        least = mixed.data.prompts.min_words_of(slot)
        fates[names[1 + slot % len(kinds)]].append(
            degenerate(text, ok, least) or mixed_seen.duplicate(text)
        )

    reference = mtbench()
    categories = sorted({c for c, _ in reference})
    assert set(kinds) <= set(categories), sorted(set(kinds) - set(categories))
    ref_vectors = embed(model, tokenizer, [t for _, t in reference])
    table = Table(title=f"requests SmolLM2 writes per kind ({args.lever}, {args.per_prompt} each)")
    for col in ("kind", "written", "kept", "duplicates", *categories):
        table.add_column(col, justify="right")
    labels: dict[str | None, list[str]] = {}  # each kept request's nearest category
    examples: dict[str | None, list[str]] = {}
    for name in names:
        texts = [text for text, _, _ in by_kind[name]]
        kept = [t for (t, _, _), fate in zip(by_kind[name], fates[name], strict=True) if not fate]
        duplicates = sum(1 for fate in fates[name] if fate and fate.endswith("duplicate"))
        labels[name] = []
        if kept:
            sims = embed(model, tokenizer, kept) @ ref_vectors.T
            labels[name] = [reference[int(j)][0] for j in sims.argmax(1)]
        examples[name] = kept[:2]
        label = "(template default)" if name is None else f"{name}: {kinds[name][:40]}"
        table.add_row(label, str(len(texts)), str(len(kept)), str(duplicates),
                      *(f"{share(labels[name], c):.0%}" for c in categories))  # fmt: skip
    Console(width=200).print(table)
    for name, texts in examples.items():
        print(f"{name or '(template default)'}:")
        for t in texts:
            print(f"    {t[:160]!r}")

    def gap(pick) -> tuple[float, float]:
        mine = sum(share(pick(labels[c]), c) for c in kinds) / len(kinds)
        return mine, sum(share(pick(labels[None]), c) for c in kinds) / len(kinds)

    mine, base = gap(lambda xs: xs)
    rng = random.Random(0)  # requests resampled within each kind
    resampled = (gap(lambda xs: rng.choices(xs, k=len(xs))) for _ in range(2000))
    diffs = sorted(m - b for m, b in resampled)
    low, high = diffs[49], diffs[1949]
    print(f"{args.lever} ({len(kinds)} kinds): {mine:.3f} of their requests nearest their own "
          f"category, against {base:.3f} of the default header's; difference "
          f"{mine - base:+.3f} [95% CI {low:+.3f} to {high:+.3f}]")  # fmt: skip
    print(f"steered_share={mine:.3f}")


def share(labels: list[str], category: str) -> float:
    return labels.count(category) / len(labels) if labels else 0.0


if __name__ == "__main__":
    main()
