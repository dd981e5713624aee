"""Export writes the SGLang/EAGLE format and refuses anything that would not load back."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_drafter import tiny_drafter

from eagletrain.drafter import with_wider_mlp
from eagletrain.export import ExportError, load_exported, write_format
from eagletrain.train.ttt import shift

SGLANG_TENSORS = {
    "fc.weight",
    "norm.weight",
    "lm_head.weight",
    "d2t",
    "t2d",
    "midlayer.input_layernorm.weight",
    "midlayer.hidden_norm.weight",
    "midlayer.post_attention_layernorm.weight",
    *(f"midlayer.self_attn.{p}_proj.weight" for p in "qkvo"),
    *(f"midlayer.mlp.{p}_proj.weight" for p in ("gate", "up", "down")),
}


def test_sglang_export_round_trips_with_the_documented_names(tmp_path):
    drafter, _ = tiny_drafter()
    write_format(drafter, tmp_path, "sglang", "target")
    assert set(load_file(tmp_path / "model.safetensors")) == SGLANG_TENSORS
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    # the same layers for vLLM, which reads a top-level field first (SGLang: eagle_config)
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert config["draft_vocab_size"] == 20 and config["target_hidden_size"] == 32
    assert config["norm_before_residual"] is False
    assert config["max_position_embeddings"] == 128
    loaded = load_exported(tmp_path)
    for name, tensor in drafter.state_dict().items():
        assert torch.equal(tensor.to(loaded.state_dict()[name].dtype), loaded.state_dict()[name])


def test_sglang_layer_ids_that_disagree_for_vllm_fail(tmp_path):
    drafter, _ = tiny_drafter()
    write_format(drafter, tmp_path, "sglang", "target")
    config = json.loads((tmp_path / "config.json").read_text())
    config["eagle_aux_hidden_state_layer_ids"] = [1, 3, 4]  # one layer early for vLLM
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ExportError, match=r"name different layers"):
        load_exported(tmp_path)


def test_a_renamed_tensor_fails_loudly(tmp_path):
    drafter, _ = tiny_drafter()
    write_format(drafter, tmp_path, "sglang", "target")
    state = load_file(tmp_path / "model.safetensors")
    state["layers.0.mlp.up_proj.weight"] = state.pop("midlayer.mlp.up_proj.weight")
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(ExportError, match=r"missing \['midlayer.mlp.up_proj.weight'\]"):
        load_exported(tmp_path)


def test_a_config_that_disagrees_with_the_tensors_fails(tmp_path):
    drafter, _ = tiny_drafter()
    write_format(drafter, tmp_path, "sglang", "target")
    config = json.loads((tmp_path / "config.json").read_text())
    config["draft_vocab_size"] = 21
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ExportError, match=r"(d2t|lm_head.weight) has shape"):
        load_exported(tmp_path)


@pytest.mark.parametrize("fmt", ["vllm", "speculators"])
def test_vllm_formats_convert_layer_ids_and_round_trip(tmp_path, fmt):
    drafter, _ = tiny_drafter()  # aux ids [1, 3, 4]: outputs of layers 1, 3, 4
    write_format(drafter, tmp_path, fmt, "org/target")
    config = json.loads((tmp_path / "config.json").read_text())
    # vLLM reads input-of-layer ids at the top level: the same layers are [2, 4, 5]
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert "eagle_config" not in config
    names = set(load_file(tmp_path / "model.safetensors"))
    if fmt == "speculators":
        assert config["architectures"] == ["Eagle3Speculator"]
        assert config["speculators_model_type"] == "eagle3"
        assert config["speculators_config"]["verifier"]["name_or_path"] == "org/target"
        assert config["transformer_layer_config"]["num_hidden_layers"] == 1
        assert config["draft_vocab_size"] == 20 and config["norm_before_residual"] is False
        assert names == {n.replace("midlayer.", "layers.0.") for n in SGLANG_TENSORS}
    else:
        assert names == SGLANG_TENSORS
    loaded = load_exported(tmp_path)
    assert list(loaded.config.eagle_aux_layer_ids) == [1, 3, 4]
    for name, tensor in drafter.state_dict().items():
        assert torch.equal(tensor.to(loaded.state_dict()[name].dtype), loaded.state_dict()[name])


def test_missing_layer_ids_are_refused_not_defaulted(tmp_path):
    drafter, _ = tiny_drafter()
    write_format(drafter, tmp_path, "vllm", "target")
    config = json.loads((tmp_path / "config.json").read_text())
    del config["eagle_aux_hidden_state_layer_ids"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ExportError, match="no explicit aux layer ids"):
        load_exported(tmp_path)


@pytest.mark.parametrize("fmt", ["sglang", "vllm", "speculators"])
def test_a_wider_mlp_exports_and_loads_as_the_same_function(tmp_path, fmt):
    """train.draft_intermediate_size: the export carries the width, and a drafter widened
    with zero units (the same function) loads back computing what the narrow one does."""
    narrow, embed = tiny_drafter()  # 64 MLP units
    wide = with_wider_mlp(narrow, 96)
    write_format(wide, tmp_path, fmt, "target")
    config = json.loads((tmp_path / "config.json").read_text())
    layer = config.get("transformer_layer_config", config)
    assert layer["intermediate_size"] == 96
    loaded = load_exported(tmp_path).double()
    aux = torch.randn(1, 6, 3 * 32, dtype=torch.float64)
    tokens, positions = torch.randint(0, 50, (1, 6)), torch.arange(6)[None]
    outs = [
        d.step_ttt(d.fc(aux), embed(shift(tokens, 1)), positions, [])[0] for d in (narrow, loaded)
    ]
    torch.testing.assert_close(outs[0], outs[1])
