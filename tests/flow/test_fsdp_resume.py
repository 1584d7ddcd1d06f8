"""Saving and loading the flow pipeline's trained weights when FSDP2 (torch ``fully_shard``) shards the transformer:
the parameters are DTensors by the time a resume loads, and a checkpoint's folder is written from the gathered
state dict of a module whose class FSDP2 has replaced."""

from __future__ import annotations

import json

import diffusers
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from mmgrpo.pipelines.flow.adapters import _save_full, load_adapter, load_full
from mmgrpo.pipelines.flow.config import FlowModelConfig


def small_sd3() -> diffusers.SD3Transformer2DModel:
    return diffusers.SD3Transformer2DModel(sample_size=16, patch_size=2, in_channels=4, num_layers=2,
                                           attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                           caption_projection_dim=32, pooled_projection_dim=16, out_channels=4)


def shard(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` sharded in place as accelerate's FSDP2 with transformer-based wrapping does: each block, then
    the root."""
    for block in model.transformer_blocks:
        fully_shard(block, reshard_after_forward=True)
    fully_shard(model, reshard_after_forward=True)
    assert all(isinstance(p, DTensor) for p in model.parameters())
    return model


def whole(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in state.items()}


def test_load_full_copies_a_sharded_folder_into_fsdp2_sharded_weights(one_process_group, tmp_path):
    """A resume loads after ``prepare``, into DTensor parameters: a whole tensor was copied into each
    (load_state_dict: "mixed torch.Tensor and DTensor"); now each process copies its own part, file by file."""
    torch.manual_seed(0)
    model = small_sd3()
    model.save_pretrained(tmp_path / "transformer", max_shard_size="100KB")
    assert (tmp_path / "transformer" / "diffusion_pytorch_model.safetensors.index.json").is_file()
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    load_full(tmp_path / "transformer", shard(model))
    loaded = whole(model.state_dict())
    assert loaded.keys() == saved.keys() and all(torch.equal(v, saved[k]) for k, v in loaded.items())
    assert all(isinstance(p, DTensor) for p in model.parameters())


def test_a_full_fine_tune_saved_from_fsdp2_loads_with_the_stock_class(one_process_group, tmp_path):
    """The folder a checkpoint writes from the gathered state dict of an FSDP2 transformer named FSDP2's class
    (``FSDPSD3Transformer2DModel``) in config.json, which no diffusers loader knows; it names the model's own."""
    torch.manual_seed(0)
    model = shard(small_sd3())
    gathered = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    _save_full(tmp_path / "transformer", model, gathered)
    config = json.loads((tmp_path / "transformer" / "config.json").read_text())
    assert config["_class_name"] == "SD3Transformer2DModel"
    stock = diffusers.AutoModel.from_pretrained(str(tmp_path / "transformer"))  # looks up _class_name
    assert type(stock) is diffusers.SD3Transformer2DModel
    assert all(torch.equal(v, gathered[k]) for k, v in stock.state_dict().items())


def test_lora_loads_into_fsdp2_sharded_weights(one_process_group, tiny_cache, tmp_path):
    """``load_trainable`` of a LoRA run into a transformer FSDP2 has sharded: the LoRA weights are DTensors. PEFT
    0.18 (which pyproject allows) copied the whole tensors into them ("mixed torch.Tensor and DTensor"); newer PEFT
    with transformers 5 places them itself, so this test fails only with the older one (run it with PEFT 0.18.1
    on PYTHONPATH to see)."""
    adapter = load_adapter(FlowModelConfig(type="sd3", path="tiny:sd3", lora_rank=4, lora_alpha=8))
    lora = {n: p for n, p in adapter.transformer.named_parameters() if p.requires_grad}
    with torch.no_grad():
        for p in lora.values():
            p.normal_()
    saved = {n: p.detach().clone() for n, p in lora.items()}
    adapter.save_trainable(tmp_path)
    with torch.no_grad():
        for p in lora.values():
            p.zero_()
    shard(adapter.transformer)
    adapter.load_trainable(tmp_path)
    loaded = whole({n: p.detach() for n, p in adapter.transformer.named_parameters() if p.requires_grad})
    assert loaded.keys() == saved.keys() and all(torch.equal(v, saved[k]) for k, v in loaded.items())


def test_a_resume_under_fsdp2_loads_the_saved_weights_and_trains_on(launch_two_processes, tmp_path):
    """Two gloo processes on accelerate's FSDP2 (tests/support/flow_fsdp_resume_check.py), full fine-tune and
    LoRA: the trainer loads step 1 after ``prepare``, into the sharded (DTensor) parameters; the loaded weights are
    the saved ones exactly, and the resumed step 2 is the uninterrupted run's (same metrics, same weights saved).
    The full fine-tune's folder loads with the stock ``SD3Transformer2DModel.from_pretrained``."""
    report = launch_two_processes("flow_fsdp_resume_check.py", tmp_path / "runs")
    for kind in ("full", "lora"):
        run = report[kind]
        assert run["sharded"] and run["loaded_max_diff"] == 0, kind
        (straight,), (resumed,) = run["rows"]
        assert straight["step"] == resumed["step"] == 2
        assert {k: v for k, v in resumed.items() if not k.startswith("time/")} == {
            k: v for k, v in straight.items() if not k.startswith("time/")}, kind  # loss, grad norm, rewards...
        assert run["step2_max_diff"] == 0 and run["step2_change"] > 0, kind
    assert report["full"]["stock_max_diff"] == 0
    assert report["full"]["class_name"] == "SD3Transformer2DModel"
