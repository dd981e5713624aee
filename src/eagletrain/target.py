"""The target model in-process (HF transformers): loading, identity, and hidden-state hooks.

Layer-id convention used everywhere in eagletrain: an aux layer id k means "the output of
decoder layer k" (0-based) = HF `output_hidden_states[k + 1]`. This is SGLang's convention;
vLLM's `eagle_aux_hidden_state_layer_ids` is k + 1 for the same layer (converted at export).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from eagletrain.config import TargetConfig
from eagletrain.embedded import embedded_file
from eagletrain.errors import InputError

LAYER_ID_CONVENTION = "output-of-layer-k (0-based; SGLang ids; vLLM id = k+1)"

_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
    "float8_e4m3fn": torch.float8_e4m3fn,  # extract.store_dtype only
}


def torch_dtype(name: str) -> torch.dtype:
    return _DTYPES[name]


def pick_device(name: str) -> torch.device:
    """ "auto": this process's GPU (LOCAL_RANK under torchrun), else the CPU."""
    if name == "auto":
        if not torch.cuda.is_available():
            return torch.device("cpu")
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device(name)


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """EAGLE-3's low/mid/high layers: outputs of layers 1, L//2-1, L-4 (0-based)."""
    return [1, num_layers // 2 - 1, num_layers - 4]


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _cache_root() -> Path:
    return Path(os.environ.get("EAGLETRAIN_CACHE", Path.home() / ".cache" / "eagletrain"))


@dataclass(frozen=True)
class TargetSource:
    """Where the HF-loadable target lives, and a stable identity string for metadata."""

    directory: Path
    identity: str


def _dequantized_gguf(gguf: Path) -> TargetSource:
    """De-quantize a GGUF once into an HF directory (safetensors) keyed by the file's hash."""
    sha = _file_sha256(gguf)
    cached = _cache_root() / "targets" / sha[:16]
    identity = f"gguf:{gguf.name}:sha256:{sha[:16]}"
    if (cached / "config.json").is_file():
        return TargetSource(cached, identity)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cached.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=cached.parent, prefix=".tmp-"))
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32
        )
        # The weights are already de-quantized floats: save them as a plain checkpoint.
        model.hf_quantizer = None
        model.config.__dict__.pop("quantization_config", None)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, cached) if not cached.exists() else shutil.rmtree(tmp)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return TargetSource(cached, identity)


def resolve_target(cfg: TargetConfig) -> TargetSource:
    if cfg.model == "smollm2":
        return _dequantized_gguf(embedded_file("smollm2"))
    path = Path(cfg.model).expanduser()
    if cfg.gguf_file:
        gguf = path / cfg.gguf_file
        if not gguf.is_file():
            raise InputError(f"{gguf}: GGUF file not found")
        return _dequantized_gguf(gguf)
    if path.is_file() and path.suffix == ".gguf":
        return _dequantized_gguf(path)
    if not (path / "config.json").is_file():
        raise InputError(f"{path}: not a model (expected an HF model directory with config.json)")
    digest = hashlib.sha256((path / "config.json").read_bytes()).hexdigest()[:16]
    return TargetSource(path, f"hf:{path.name}:config-sha256:{digest}")


def load_tokenizer(source: TargetSource) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(source.directory)
    except (OSError, ValueError) as err:
        raise InputError(f"{source.directory}: cannot load tokenizer: {err}") from None


def load_target(source: TargetSource, dtype: str, device: torch.device) -> nn.Module:
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(source.directory, dtype=torch_dtype(dtype))
    except (OSError, ValueError) as err:
        raise InputError(f"{source.directory}: cannot load model: {err}") from None
    model.to(device).eval().requires_grad_(False)
    return model


def template_hash(tokenizer: Any) -> str:
    template = tokenizer.chat_template or ""
    return hashlib.sha256(template.encode()).hexdigest()[:16]


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    return model.model.layers


@contextmanager
def capture_layer_outputs(model: nn.Module, layer_ids: list[int]) -> Iterator[dict[int, Any]]:
    """Forward hooks that keep the residual-stream output of the given decoder layers."""
    captured: dict[int, torch.Tensor] = {}
    layers = decoder_layers(model)

    def hook_for(idx: int):
        def hook(_module: nn.Module, _args: Any, output: Any) -> None:
            captured[idx] = output[0] if isinstance(output, tuple) else output

        return hook

    handles = [layers[i].register_forward_hook(hook_for(i)) for i in sorted(set(layer_ids))]
    try:
        yield captured
    finally:
        for handle in handles:
            handle.remove()


def target_features(
    model: nn.Module, input_ids: torch.Tensor, valid: torch.Tensor, aux_ids: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """One right-padded forward of the target: (aux [B, T, 3H], last [B, T, H]), the three
    aux layers' outputs and the last decoder layer's output before the final norm."""
    return _layer_features(model, aux_ids, input_ids=input_ids, attention_mask=valid.long())


def packed_target_features(
    model: nn.Module, input_ids: torch.Tensor, positions: torch.Tensor, aux_ids: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """`target_features` of packed rows ([B, T], several samples a row, `positions`
    restarting at each): no attention mask, so transformers reads the samples' bounds from
    the position ids (a restart begins a sample) and keeps attention within each."""
    return _layer_features(model, aux_ids, input_ids=input_ids, position_ids=positions)


def _layer_features(
    model: nn.Module, aux_ids: list[int], **inputs: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(aux, last) of one forward of the target's decoder stack on `inputs`."""
    last_id = model.config.num_hidden_layers - 1
    with torch.inference_mode(), capture_layer_outputs(model, [*aux_ids, last_id]) as captured:
        model.model(**inputs, use_cache=False)
        aux = torch.cat([captured[i] for i in aux_ids], dim=-1)
    # copied outside inference mode: the features may enter autograd as they are
    return aux.clone(), captured[last_id].clone()


def target_eos(model: torch.nn.Module, tokenizer: Any) -> set[int]:
    """The target's end-of-sequence ids: its config's, its generation config's and its
    tokenizer's (a chat model may end a turn on any of them)."""
    eos: set[int] = set()
    for source in (model.config, getattr(model, "generation_config", None)):
        ids = getattr(source, "eos_token_id", None)
        eos |= {int(ids)} if isinstance(ids, int) else {int(i) for i in ids or []}
    if tokenizer.eos_token_id is not None:
        eos.add(int(tokenizer.eos_token_id))
    return eos
