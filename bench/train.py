"""Trainer throughput, MFU and peak memory on a Llama-3.1-8B-shaped drafter.

    .venv/bin/python bench/train.py [--batches 1,2,4,8,16] [--seq 2048] [--ttt 7] [--iters 5]

The drafter (hidden 4096, intermediate 14336, 32/8 heads, target vocab 128256, draft vocab
32000) is eagletrain's own `Eagle3Drafter`, trained by the trainer's own `train_step` (exact TTT
attention pattern) on random features, with the frozen target head producing the target
distribution from a random last-layer state, bf16 autocast and fused AdamW, as train.py.
FLOPs per token: 6 x (TTT x (q,k,v,o + MLP + lm_head MACs + seq x hidden) + fc MACs)
+ 2 x hidden x draft_vocab, over a 790 TFLOP/s bf16 ceiling (H200, measured).
Each TTT step's head loss is fused (head_loss.py); `--recompute on` adds activation
checkpointing of each step's decoder layer, `--compile on` torch.compile of the decoder layer
(drafter.compile_decoder_layer). A batch that does not fit is reported as OOM. Before the
table, flex and dense attention are compared on one batch, with and without packed rows.
Prints a table (and with `--profile` the top kernels of one configuration), then
`mfu=<x>` last: the best flex MFU at batch 8 within the 25 GiB goal (0 if none).
"""

from __future__ import annotations

import argparse
import time

import torch
from rich.console import Console
from rich.table import Table
from transformers import LlamaConfig

from eagletrain.drafter import (
    Eagle3Drafter,
    compile_decoder_layer,
    drafter_config,
    set_ttt_attention,
)
from eagletrain.train.batches import Batch
from eagletrain.train.parallel import Parallel
from eagletrain.train.step import Optimization, train_step
from eagletrain.train.ttt import TargetHead, TTTObjective, TTTSettings, step_weights, ttt_forward

PEAK_FLOPS = 790e12


def flops_per_token(cfg: LlamaConfig, seq: int, ttt: int) -> float:
    h, i, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q = 2 * h * cfg.num_attention_heads * hd
    kv = 2 * (2 * h * cfg.num_key_value_heads * hd)
    o = cfg.num_attention_heads * hd * h
    per_step = q + kv + o + 3 * h * i + h * cfg.draft_vocab_size + seq * h
    fc = 3 * cfg.target_hidden_size * h
    return 6 * (ttt * per_step + fc) + 2 * h * cfg.draft_vocab_size


def agreement(
    drafter, embed, head, weights, ttt: int, packed: bool, b: int = 2, t: int = 384
) -> str:
    """flex and dense TTT attention on the same batch: loss and fc-gradient difference.
    `packed`: each row holds three samples (positions restart, segments 1..3)."""
    device = embed.weight.device
    torch.manual_seed(1)
    aux = torch.randn(b, t, 3 * 4096, device=device, dtype=torch.bfloat16)
    last = torch.randn(b, t, 4096, device=device, dtype=torch.bfloat16)
    ids = torch.randint(0, drafter.config.vocab_size, (b, t), device=device)
    mask = torch.ones(b, t, dtype=torch.bool, device=device)
    extra = {}
    if packed:
        cuts = torch.tensor([0, 100, 250, t], device=device)
        index = torch.arange(t, device=device)
        segment = torch.bucketize(index, cuts[1:-1], right=True)
        extra = {
            "positions": (index - cuts[segment]).expand(b, t),
            "segments": (segment + 1).expand(b, t),
        }
    with torch.no_grad():
        p, in_vocab = head.distribution(last, drafter.target_ids(), drafter.t2d)
    out = {}
    for mode in ("dense", "flex"):
        set_ttt_attention(drafter, mode)
        drafter.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            batch = Batch(aux, last, ids, mask, **extra)
            r = ttt_forward(drafter, embed, batch, p, in_vocab, TTTSettings(ttt, weights))
        r.loss.backward()
        out[mode] = (r.loss.item(), drafter.fc.weight.grad.float().clone())
    drafter.zero_grad(set_to_none=True)
    (ld, gd), (lf, gf) = out["dense"], out["flex"]
    rel = float((gd - gf).norm() / gd.norm())
    what = "packed rows" if packed else "one sample per row"
    return (
        f"flex vs dense ({what}): loss {lf:.5f} vs {ld:.5f}, fc grad relative difference {rel:.2e}"
    )


def profile_step(step) -> str:
    """The kernels that take the time in one training step (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    averages = prof.key_averages()
    try:
        return averages.table(sort_by="self_device_time_total", row_limit=20)
    except (AttributeError, KeyError, ValueError):
        return averages.table(sort_by="self_cuda_time_total", row_limit=20)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", default="1,2,4,8,16")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--ttt", type=int, default=7)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--attention", default="dense,flex", help="TTT attention paths to run")
    parser.add_argument(
        "--recompute", default="off,on", help="activation checkpointing per TTT step: off,on"
    )
    parser.add_argument(
        "--compile", default="off", help="torch.compile of the decoder layer: off,on"
    )
    parser.add_argument(
        "--profile", default="", help="MODE:RECOMPUTE:COMPILE:BATCH to profile, e.g. flex:off:on:8"
    )
    args = parser.parse_args()
    device = torch.device("cuda")
    target = LlamaConfig(
        hidden_size=4096,
        intermediate_size=14336,
        num_attention_heads=32,
        num_key_value_heads=8,
        num_hidden_layers=32,
        vocab_size=128256,
        max_position_embeddings=8192,
        rope_theta=500000.0,
    )
    cfg = drafter_config(target, 32000, [1, 15, 28], False)
    torch.manual_seed(0)
    drafter = Eagle3Drafter(cfg).to(device)
    drafter.set_draft_vocab(torch.randperm(cfg.vocab_size, device=device)[:32000].sort().values)
    embed = torch.nn.Embedding(cfg.vocab_size, 4096).to(device, torch.bfloat16)
    embed.requires_grad_(False)
    head = TargetHead(
        torch.ones(4096, device=device),
        1e-5,
        (torch.randn(cfg.vocab_size, 4096, device=device) * 0.02).to(torch.bfloat16),
    )
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=1e-4, fused=True)
    opt = Optimization(optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0), 0.5)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16)
    weights = step_weights(args.ttt, 0.8)
    per_token = flops_per_token(cfg, args.seq, args.ttt)
    rows, headline = [], None
    checks = [agreement(drafter, embed, head, weights, args.ttt, packed) for packed in (0, 1)]
    print("\n".join(checks), flush=True)
    variants = [
        (m, r, c, int(x))
        for c in args.compile.split(",")
        for m in args.attention.split(",")
        for r in args.recompute.split(",")
        for x in args.batches.split(",")
    ]
    profile = None
    for mode, recompute, compiled, b in variants:
        set_ttt_attention(drafter, mode)
        if compiled == "on" and drafter.midlayer._compiled_call_impl is None:
            compile_decoder_layer(drafter)
        elif compiled == "off":
            drafter.midlayer._compiled_call_impl = None
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        try:
            aux = torch.randn(b, args.seq, 3 * 4096, device=device, dtype=torch.bfloat16)
            last = torch.randn(b, args.seq, 4096, device=device, dtype=torch.bfloat16)
            ids = torch.randint(0, cfg.vocab_size, (b, args.seq), device=device)
            mask = torch.ones(b, args.seq, dtype=torch.bool, device=device)

            settings = TTTSettings(args.ttt, weights, recompute == "on", compile_head=True)
            objective = TTTObjective(drafter, embed, settings)
            batch = Batch(aux, last, ids, mask)

            def step(objective=objective, batch=batch) -> None:
                # the trainer's own step: target distribution, TTT, backward, clip, update
                train_step(objective, head, batch, opt, Parallel(), autocast)

            step()  # warm-up
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(args.iters):
                step()
            torch.cuda.synchronize()
            elapsed = (time.perf_counter() - start) / args.iters
            tokens_s = b * args.seq / elapsed
            mfu = tokens_s * per_token / PEAK_FLOPS
            peak = torch.cuda.max_memory_allocated() / 2**30
            rows.append(
                (
                    mode,
                    recompute,
                    compiled,
                    b,
                    f"{elapsed * 1e3:.0f}",
                    f"{tokens_s:,.0f}",
                    f"{mfu:.3f}",
                    f"{peak:.1f}",
                )
            )
            print("row", *rows[-1], flush=True)  # kept if the run is stopped later
            if b == 8 and mode == "flex" and peak < 25:
                headline = max(headline or 0.0, mfu)
            if args.profile == f"{mode}:{recompute}:{compiled}:{b}":
                profile = profile_step(step)
        except torch.OutOfMemoryError:
            rows.append((mode, recompute, compiled, b, "-", "-", "-", "OOM"))
        finally:
            aux = last = ids = mask = None
    table = Table(
        title=f"drafter train step, 8B shape, seq {args.seq}, TTT {args.ttt}, "
        f"{per_token / 1e9:.2f} GFLOP/token"
    )
    for col in (
        "attention",
        "recompute",
        "compile",
        "batch",
        "ms/step",
        "tokens/s",
        "MFU",
        "peak GiB",
    ):
        table.add_column(col, justify="right")
    for row in rows:
        table.add_row(*map(str, row))
    Console(width=120).print(table)
    print("\n".join(checks))
    best = max((float(r[6]) for r in rows if r[6] != "-"), default=0.0)
    print(f"best MFU of any row: {best:.3f}")
    if profile:
        print(profile)
    print(f"mfu={headline if headline is not None else 0:.3f}")


if __name__ == "__main__":
    main()
