"""Does a system header steer what the target asks? Prompts the target writes itself under
each of several system prompts (`data.prompts.system_prompts`, the local writer of the data
stage), each judged by the MT-bench category of its nearest MT-bench turn-1 prompt in the
target's own representation (mean of the last hidden state over the text, cosine).

Prints, per system prompt: the requests written, those the data stage would keep (not
degenerate, dedupe.py), and the share of kept ones nearest each MT-bench category; then
two examples each. The headline is the mean share of a category prompt's requests nearest
its own category, against the template's default header's share of that category,
printed last as `steered_share=<value>`, with the difference's 95% bootstrap interval
(requests resampled within each header).

    python bench/self_prompt_mix.py [--per-prompt 16] [--config configs/smollm2-scale.toml]

The headers are the config's `data.prompts.system_prompts` when it sets them, else one per
MT-bench category (CATEGORY_HEADERS), each naming its category.
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
from eagletrain.data.dedupe import degenerate
from eagletrain.data.self_prompts import local_writer
from eagletrain.embedded import embedded_file
from eagletrain.target import load_target, load_tokenizer, pick_device, resolve_target, target_eos

CATEGORY_HEADERS = [
    "You are a helpful AI assistant. People come to you for help with writing: stories, "
    "poems, essays, emails and blog posts.",
    "You are a helpful AI assistant. People ask you to take part in roleplay, playing the "
    "characters and personas they describe.",
    "You are a helpful AI assistant. People bring you puzzles and logic questions that need "
    "careful reasoning.",
    "You are a helpful AI assistant. People ask you math questions: arithmetic, algebra, "
    "geometry and probability problems to solve.",
    "You are a helpful AI assistant. People ask you for help with coding: programs in "
    "Python, C++, JavaScript and SQL to create, explain or fix.",
    "You are a helpful AI assistant. People give you texts and ask for the extraction of "
    "names, dates, numbers and facts, often as JSON.",
    "You are a helpful AI assistant. People ask you STEM questions about physics, "
    "chemistry, biology and engineering.",
    "You are a helpful AI assistant. People ask you about the humanities: history, "
    "philosophy, economics, law and the arts.",
]


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
    parser.add_argument("--per-prompt", type=int, default=16, help="requests per system prompt")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()

    config = load_config(Path(args.config))
    cfg = config.data.prompts
    mix = cfg.system_prompts or CATEGORY_HEADERS
    headers = [None, *mix]  # None: the template's default header
    device = pick_device(args.device)
    source = resolve_target(config.target)
    tokenizer = load_tokenizer(source)
    model = load_target(source, args.dtype, device).eval()
    eos = target_eos(model, tokenizer)
    # the default header, then the mix (slot s under mix[s % n]): the data stage's writer
    alone = config.model_copy(deep=True)
    alone.data.prompts.system_prompt, alone.data.prompts.system_prompts = None, []
    mixed = config.model_copy(deep=True)
    mixed.data.prompts.system_prompt, mixed.data.prompts.system_prompts = None, mix
    # one batch each: as many decoder rows as requests (the config's may be thousands)
    alone.data.prompts.batch_size = args.per_prompt
    mixed.data.prompts.batch_size = args.per_prompt * len(mix)
    by_header: dict[str | None, list[tuple[str, int, bool]]] = {
        None: local_writer(model, tokenizer, alone, eos)([(s, 0) for s in range(args.per_prompt)])
    }
    written = local_writer(model, tokenizer, mixed, eos)(
        [(s, 0) for s in range(args.per_prompt * len(mix))]
    )
    for i, header in enumerate(mix):
        by_header[header] = written[i :: len(mix)]

    reference = mtbench()
    categories = sorted({c for c, _ in reference})
    ref_vectors = embed(model, tokenizer, [t for _, t in reference])
    table = Table(
        title=f"requests SmolLM2 writes under each system header ({args.per_prompt} each)"
    )
    for col in ("system header", "written", "kept", *categories):
        table.add_column(col, justify="right")
    labels: dict[str | None, list[str]] = {}  # each kept request's nearest category
    examples: dict[str | None, list[str]] = {}
    for header in headers:
        texts = [text for text, _, _ in by_header[header]]
        kept = [t for t, _, ok in by_header[header] if not degenerate(t, ok, cfg.min_words)]
        labels[header] = []
        if kept:
            sims = embed(model, tokenizer, kept) @ ref_vectors.T
            labels[header] = [reference[int(j)][0] for j in sims.argmax(1)]
        examples[header] = kept[:2]
        name = "(template default)" if header is None else header[:48]
        table.add_row(name, str(len(texts)), str(len(kept)),
                      *(f"{share(labels[header], c):.0%}" for c in categories))  # fmt: skip
    Console(width=200).print(table)
    for header, texts in examples.items():
        print(f"{header or '(template default)'}:")
        for t in texts:
            print(f"    {t[:160]!r}")
    # a header that names one category: its share of that category against the default's
    pairs = [
        (h, named[0]) for h in mix if len(named := [c for c in categories if c in h.lower()]) == 1
    ]
    if not pairs:
        return

    def gap(pick) -> tuple[float, float]:
        mine = sum(share(pick(labels[h]), c) for h, c in pairs) / len(pairs)
        return mine, sum(share(pick(labels[None]), c) for _, c in pairs) / len(pairs)

    mine, base = gap(lambda xs: xs)
    rng = random.Random(0)  # requests resampled within each header
    resampled = (gap(lambda xs: rng.choices(xs, k=len(xs))) for _ in range(2000))
    diffs = sorted(m - b for m, b in resampled)
    low, high = diffs[49], diffs[1949]
    print(f"headers naming one category ({len(pairs)}): {mine:.3f} of their requests nearest it, "
          f"against {base:.3f} of the default header's; difference {mine - base:+.3f} "
          f"[95% CI {low:+.3f} to {high:+.3f}]")  # fmt: skip
    print(f"steered_share={mine:.3f}")


def share(labels: list[str], category: str) -> float:
    return labels.count(category) / len(labels) if labels else 0.0


if __name__ == "__main__":
    main()
