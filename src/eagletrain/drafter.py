"""The EAGLE-3 drafter: fc over three target layers, one Llama decoder layer whose attention
reads concat(embed(token), hidden), a final norm and a head over the reduced draft vocab.

Module names are the SGLang/EAGLE checkpoint's tensor names (`fc`, `midlayer.*`, `norm`,
`lm_head`, `d2t`, `t2d`), so export is a plain state_dict. The target's token embedding is
frozen and lives outside this module (it is not exported; engines reuse the target's).

Rotary positions: the drafter's index i pairs the target feature of position i with token
i+1 and uses rope position i; TTT step k (the k-th drafted token of a chain) uses i + k,
as a serving engine advances positions by one per draft step.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterator
from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
    repeat_kv,
)

KV = tuple[torch.Tensor, torch.Tensor]

# TTT attention (train.ttt_attention): "flex" (flex_attention over the block-sparse TTT
# mask), "dense" (the scores materialised, plain matmuls: the reference), "auto" (flex on
# CUDA, dense elsewhere)
TTTAttention = Literal["auto", "flex", "dense"]


@functools.cache
def _flex_attention():
    import torch._dynamo
    from torch.nn.attention.flex_attention import flex_attention

    # one compiled kernel per shape (a TTT step's keys in their own shape, where the caller
    # gives no unroll length; each sequence length): more than dynamo's default 8, past
    # which it would fall back to the slow unfused path
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 256)
    return torch.compile(flex_attention, dynamic=False)


class TTTKeys(NamedTuple):
    """Earlier TTT steps' keys and values in one layout for flex attention: step j's at
    indices j*t..(j+1)*t of `keys` / `values` [B, KV heads, (slots - 1) * t, D], zeros in
    the slots of steps not yet run, the attending step's own keys appended as the last
    slot; `step` (0-dim tensor) is the attending step. With the slots fixed at the unroll's
    length every step has the same shapes, so the compiled decoder layer and flex build one
    kernel for all steps, not one per step (7 cost ~280 s to compile on an H100)."""

    keys: torch.Tensor
    values: torch.Tensor
    step: torch.Tensor


def ttt_keys(earlier: list[KV], slots: int, like: torch.Tensor) -> TTTKeys:
    """`earlier` (step 0 first) laid out in `slots` slots shaped, typed and placed as `like`
    (one step's keys, [B, KV heads, t, D]); the attending step's own keys make the last."""
    b, heads, t, d = like.shape
    pad = like.new_zeros(b, heads, (slots - 1 - len(earlier)) * t, d)
    keys = torch.cat([*(k.to(like.dtype) for k, _ in earlier), pad], dim=2)
    values = torch.cat([*(v.to(like.dtype) for _, v in earlier), pad], dim=2)
    # a fill on the device: torch.tensor() would copy from the host and wait for the GPU
    step = torch.full((), len(earlier), dtype=torch.long, device=like.device)
    return TTTKeys(keys, values, step)


def _ttt_block_mask(
    step: torch.Tensor,
    t: int,
    slots: int,
    segments: torch.Tensor | None,
    device: torch.device,
    compiled: bool = False,
):
    """Queries at index q see step 0's keys at indices <= q (within the query's sample with
    `segments` [B, t], packed rows) and, in each later step's slot up to the attending
    `step`'s own (the last slot), the key at index q only. Step 0's own keys sit in the last
    slot. `compiled` builds it with create_block_mask's own compiled path (bench/
    train_online.py times both)."""
    from torch.nn.attention.flex_attention import create_block_mask

    last = slots - 1

    def mask_mod(b, h, q, kv):
        slot, index = kv // t, kv % t
        own = slot == last
        prefix = torch.where(step == 0, own, slot == 0) & (index <= q)
        if segments is not None:
            prefix = prefix & (segments[b, index] == segments[b, q])
        chain = (step > 0) & (((slot >= 1) & (slot < step)) | own) & (index == q)
        return prefix | chain

    rows = None if segments is None else segments.shape[0]
    return create_block_mask(mask_mod, rows, None, t, slots * t, device=device, _compile=compiled)


def compile_decoder_layer(drafter: Eagle3Drafter) -> None:
    """torch.compile the decoder layer in place: RMSNorms, rotary, SiLU-and-mul and the
    residual adds fuse around the GEMMs (in eager they were a third of a training step's
    time). One graph for every TTT step where the trainer passes the unroll's length
    (`TTTKeys`); the recompile limit is raised as for flex_attention for the callers that
    do not."""
    import torch._dynamo

    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 256)
    drafter.midlayer.compile(dynamic=False)


@contextlib.contextmanager
def dense_ttt_attention(drafter: nn.Module) -> Iterator[None]:
    """TTT attention without flex_attention inside: the same figures with no kernel to
    compile (held-out evaluation: its gradient-free forward would compile one per TTT step
    and shape, 113 s on the H200 for a 135M target's drafter)."""
    layers = {m: m.ttt_attention for m in drafter.modules() if isinstance(m, Eagle3Attention)}
    set_ttt_attention(drafter, "dense")
    try:
        yield
    finally:
        for m, mode in layers.items():
            m.ttt_attention = mode


def set_ttt_attention(drafter: nn.Module, mode: TTTAttention) -> None:
    for m in drafter.modules():
        if isinstance(m, Eagle3Attention):
            m.ttt_attention = mode


def drafter_config(
    target: LlamaConfig,
    draft_vocab_size: int,
    aux_layer_ids: list[int],
    norm_before_residual: bool = False,
    intermediate_size: int | None = None,
) -> LlamaConfig:
    """The drafter's config, derived from the target's (one decoder layer, same shapes; the
    MLP `intermediate_size` wide if given)."""
    head_dim = getattr(target, "head_dim", None) or target.hidden_size // target.num_attention_heads
    rope = getattr(target, "rope_parameters", None) or {
        "rope_type": "default",
        "rope_theta": getattr(target, "rope_theta", 10000.0),
        **(getattr(target, "rope_scaling", None) or {}),
    }
    return LlamaConfig(
        hidden_size=target.hidden_size,
        intermediate_size=intermediate_size or target.intermediate_size,
        num_attention_heads=target.num_attention_heads,
        num_key_value_heads=target.num_key_value_heads,
        head_dim=head_dim,
        hidden_act=target.hidden_act,
        rms_norm_eps=target.rms_norm_eps,
        max_position_embeddings=target.max_position_embeddings,
        rope_parameters=dict(rope),
        rope_theta=rope.get("rope_theta", 10000.0),
        vocab_size=target.vocab_size,
        num_hidden_layers=1,
        tie_word_embeddings=False,
        draft_vocab_size=draft_vocab_size,
        target_hidden_size=target.hidden_size,
        eagle_aux_layer_ids=list(aux_layer_ids),
        norm_before_residual=norm_before_residual,
    )


class Eagle3Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        h, hd = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            hd,
        )
        self.q_proj = nn.Linear(2 * h, self.num_heads * hd, bias=False)
        self.k_proj = nn.Linear(2 * h, self.num_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(2 * h, self.num_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(self.num_heads * hd, h, bias=False)
        self.ttt_attention: TTTAttention = "auto"  # set_ttt_attention()

    def _qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)
        return q, k, v

    def _out(self, o: torch.Tensor) -> torch.Tensor:
        b, _, t, _ = o.shape
        return self.o_proj(o.transpose(1, 2).reshape(b, t, -1))

    def uses_flex(self, x: torch.Tensor) -> bool:
        return self.ttt_attention == "flex" or (self.ttt_attention == "auto" and x.is_cuda)

    def forward_ttt(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        earlier: list[KV] | TTTKeys,
        segments: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, KV]:
        """Training-time test attention: (output, this step's keys/values). `earlier` holds
        the keys/values of earlier steps (step 0 first; as `TTTKeys` on the flex path) and
        is not changed, so a step can be recomputed (activation checkpointing). The query of
        step k at index i sees step 0's keys at indices <= i (the target-feature prefix) and
        steps 1..k at index i only. With `segments` (packed rows, [B, t]) the prefix is also
        cut at sample boundaries."""
        q, k, v = self._qkv(x, cos, sin)
        if self.uses_flex(x):
            t = x.shape[1]
            if not isinstance(earlier, TTTKeys):  # no padding: slots for these steps only
                earlier = ttt_keys(earlier, len(earlier) + 1, k)
            keys = torch.cat([earlier.keys, k], dim=2)
            values = torch.cat([earlier.values, v], dim=2)
            slots = keys.shape[2] // t
            out = _flex_attention()(
                q,
                keys,
                values,
                block_mask=_ttt_block_mask(earlier.step, t, slots, segments, x.device),
                scale=1.0 / math.sqrt(self.head_dim),
                enable_gqa=True,
            )
            return self._out(out), (k, v)
        assert isinstance(earlier, list), "TTTKeys are for flex attention"
        past = [*earlier, (k, v)]
        rep = self.num_heads // self.num_kv_heads
        k0, v0 = repeat_kv(past[0][0], rep), repeat_kv(past[0][1], rep)
        scale = 1.0 / math.sqrt(self.head_dim)
        t = x.shape[1]
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        if segments is not None:
            causal = causal & (segments[:, None, :, None] == segments[:, None, None, :])
        prefix = (q @ k0.transpose(-1, -2)) * scale
        prefix = prefix.masked_fill(~causal, torch.finfo(prefix.dtype).min)
        chain_k = [repeat_kv(kj, rep) for kj, _ in past[1:]]
        chain_v = [repeat_kv(vj, rep) for _, vj in past[1:]]
        diag = [((q * kj).sum(-1) * scale).unsqueeze(-1) for kj in chain_k]
        probs = torch.softmax(torch.cat([prefix, *diag], dim=-1).float(), dim=-1).to(q.dtype)
        out = probs[..., :t] @ v0
        for j, vj in enumerate(chain_v):
            out = out + probs[..., t + j : t + j + 1] * vj
        return self._out(out), (k, v)

    def forward_cached(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: DraftKVCache,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Decoding: new positions attend causally to the cache and to each other, or as
        `mask` [new, cache + new] (bool, True = attend) says (tree drafting)."""
        q, k, v = self._qkv(x, cos, sin)
        k_all, v_all = cache.append(k, v)
        rep = self.num_heads // self.num_kv_heads
        t, total = x.shape[1], k_all.shape[2]
        if mask is None:
            mask = torch.ones(t, total, dtype=torch.bool, device=x.device).tril(total - t)
        o = F.scaled_dot_product_attention(
            q, repeat_kv(k_all, rep), repeat_kv(v_all, rep), attn_mask=mask
        )
        return self._out(o)

    def forward_static(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        slots: torch.Tensor,
        allowed: torch.Tensor,
    ) -> torch.Tensor:
        """Decoding on preallocated key/value buffers: the new positions are written at
        `slots` (in place) and attend as `allowed` [new, buffer length] (bool) says."""
        q, k, v = self._qkv(x, cos, sin)
        keys.index_copy_(2, slots, k)
        values.index_copy_(2, slots, v)
        rep = self.num_heads // self.num_kv_heads
        o = F.scaled_dot_product_attention(
            q, repeat_kv(keys, rep), repeat_kv(values, rep), attn_mask=allowed
        )
        return self._out(o)


class DraftKVCache:
    """The drafter's key/value cache for decoding; `crop` drops rejected draft positions."""

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def __len__(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> KV:
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        return self.k, self.v

    def crop(self, length: int) -> None:
        if self.k is not None:
            self.k, self.v = self.k[:, :, :length], self.v[:, :, :length]


class Eagle3MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Float32RMSNorm(nn.RMSNorm):
    """RMSNorm computed in float32 and returned in the input's dtype, as the target's own
    Llama norm does. Under bf16 autocast the input is bf16 and the weight float32; torch's
    fused kernel needs both alike (else it warns and takes its slow path)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = torch.promote_types(x.dtype, torch.float32)  # float64 stays float64
        weight = None if self.weight is None else self.weight.to(dtype)
        return F.rms_norm(x.to(dtype), self.normalized_shape, weight, self.eps).to(x.dtype)


class Eagle3DecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.norm_before_residual = bool(getattr(cfg, "norm_before_residual", False))
        self.input_layernorm = Float32RMSNorm(h, eps=eps)
        self.hidden_norm = Float32RMSNorm(h, eps=eps)
        self.self_attn = Eagle3Attention(cfg)
        self.post_attention_layernorm = Float32RMSNorm(h, eps=eps)
        self.mlp = Eagle3MLP(cfg)

    def forward(self, hidden: torch.Tensor, embeds: torch.Tensor, attend) -> torch.Tensor:
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)
        hidden = residual + attend(self.self_attn, x)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class Eagle3Drafter(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.config = cfg
        h = cfg.hidden_size
        self.fc = nn.Linear(3 * cfg.target_hidden_size, h, bias=False)
        self.midlayer = Eagle3DecoderLayer(cfg)
        self.norm = Float32RMSNorm(h, eps=cfg.rms_norm_eps)
        self.lm_head = nn.Linear(h, cfg.draft_vocab_size, bias=False)
        # target id of draft id i is i + d2t[i]; t2d marks target ids present in the draft vocab
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))
        self.rotary = LlamaRotaryEmbedding(cfg)

    def set_draft_vocab(self, draft_ids: torch.Tensor) -> None:
        """draft_ids[i] = the target token id of draft token i."""
        self.d2t.copy_(draft_ids - torch.arange(len(draft_ids), device=draft_ids.device))
        self.t2d.zero_()
        self.t2d[draft_ids] = True

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def target_ids(self) -> torch.Tensor:
        return self.draft_to_target(torch.arange(len(self.d2t), device=self.d2t.device))

    def rope(self, hidden: torch.Tensor, positions: torch.Tensor):
        return self.rotary(hidden, positions)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden))

    def step_ttt(
        self,
        hidden: torch.Tensor,
        embeds: torch.Tensor,
        positions: torch.Tensor,
        earlier: list[KV],
        segments: torch.Tensor | None = None,
        steps: int | None = None,
    ) -> tuple[torch.Tensor, KV]:
        """One TTT step: (hidden, this step's keys/values); `earlier` is left unchanged.
        `segments` marks the samples of packed rows (None: one sample per row). `steps`, the
        unroll's length: flex attention then sees every step in the same shapes."""
        cos, sin = self.rope(hidden, positions)
        kv: list[KV] = []
        attn = self.midlayer.self_attn
        if steps is not None and attn.uses_flex(hidden):
            b, t = hidden.shape[:2]
            device = hidden.device.type
            autocast = torch.is_autocast_enabled(device)
            dtype = torch.get_autocast_dtype(device) if autocast else hidden.dtype
            like = hidden.new_empty(b, attn.num_kv_heads, t, attn.head_dim, dtype=dtype)
            earlier = ttt_keys(earlier, steps, like)  # type: ignore[assignment]

        def attend(attn: Eagle3Attention, x: torch.Tensor) -> torch.Tensor:
            out, step_kv = attn.forward_ttt(x, cos, sin, earlier, segments)
            kv.append(step_kv)
            return out

        return self.midlayer(hidden, embeds, attend), kv[0]

    def step_cached(
        self,
        hidden: torch.Tensor,
        embeds: torch.Tensor,
        positions: torch.Tensor,
        cache: DraftKVCache,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        cos, sin = self.rope(hidden, positions)
        return self.midlayer(
            hidden, embeds, lambda attn, x: attn.forward_cached(x, cos, sin, cache, mask)
        )


def with_wider_mlp(drafter: Eagle3Drafter, units: int) -> Eagle3Drafter:
    """A copy with `units` (more) MLP units, the added ones zero: the same function."""
    hidden, extra = drafter.config.hidden_size, units - drafter.config.intermediate_size
    wide = Eagle3Drafter(LlamaConfig(**{**drafter.config.to_dict(), "intermediate_size": units}))
    state = {k: v.clone() for k, v in drafter.state_dict().items()}
    for name in ("gate_proj", "up_proj"):  # zero rows: act(0) * 0 = 0
        key = f"midlayer.mlp.{name}.weight"
        state[key] = torch.cat([state[key], state[key].new_zeros(extra, hidden)])
    key = "midlayer.mlp.down_proj.weight"  # zero columns
    state[key] = torch.cat([state[key], state[key].new_zeros(hidden, extra)], dim=1)
    wide.load_state_dict(state)
    return wide.to(next(drafter.parameters()).dtype)
