"""Tests of the tiny real-format flow pipelines (pipelines/flow/tiny.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import diffusers
import pytest
import torch
import transformers

from mmgrpo.pipelines.flow import tiny
from mmgrpo.pipelines.flow.tiny import KINDS, build_tiny_pipeline, clip_tokenizer, t5_tokenizer, tiny_path

PIPELINES = {"sd3": "StableDiffusion3Pipeline", "flux": "FluxPipeline", "wan": "WanPipeline"}


def test_clip_tokenizer_is_the_real_clip_bpe():
    tok = clip_tokenizer()
    assert len(tok) == 49408 and tok.model_max_length == 77
    # Known ids of OpenAI CLIP: <|startoftext|> a photo of a cat <|endoftext|>
    assert tok("a photo of a cat").input_ids == [49406, 320, 1125, 539, 320, 2368, 49407]
    padded = tok(["a cat"], padding="max_length", max_length=77, truncation=True).input_ids[0]
    assert len(padded) == 77 and padded[-1] == tok.pad_token_id


def test_t5_tokenizer_has_t5_special_tokens_and_round_trips():
    tok = t5_tokenizer()
    assert (tok.pad_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2)
    assert 500 < len(tok) <= tiny.T5_VOCAB
    ids = tok("a photo of a red cube").input_ids
    assert ids[-1] == tok.eos_token_id and tok.unk_token_id not in ids
    assert len(ids) < 12  # whole-word pieces, not one token per character
    assert tok.decode(ids, skip_special_tokens=True) == "a photo of a red cube"


def test_build_depends_only_on_the_seed(tmp_path, tiny_cache):
    torch.manual_seed(123)
    before = torch.rand(1)
    paths = [tiny_path("wan")] + [build_tiny_pipeline("wan", tmp_path / str(seed), seed=seed) for seed in (0, 1)]
    torch.manual_seed(123)
    assert torch.equal(torch.rand(1), before)  # the global RNG is untouched
    weights = [(p / "transformer" / "diffusion_pytorch_model.safetensors").read_bytes() for p in paths]
    assert weights[0] == weights[1] != weights[2]


@pytest.mark.parametrize("kind", KINDS)
def test_stock_pipeline_runs_on_the_saved_folder(kind, tiny_cache):
    folder = tiny_path(kind)
    assert json.loads((folder / "model_index.json").read_text())["_class_name"] == PIPELINES[kind]
    size_mb = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) / 2**20
    assert size_mb < 25
    assert not list(folder.rglob("*.bin"))  # safetensors only
    pipe = getattr(diffusers, PIPELINES[kind]).from_pretrained(folder, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    frames = {"num_frames": 5} if kind == "wan" else {}
    out = pipe(["a red cube", "a cat"], num_inference_steps=2, height=64, width=64, output_type="pt",
               generator=torch.Generator().manual_seed(0), return_dict=False, **frames)[0]
    assert out.shape == ((2, 5, 3, 64, 64) if kind == "wan" else (2, 3, 64, 64))
    assert torch.isfinite(out).all() and out.min() >= 0 and out.max() <= 1 and out.std() > 0


def test_tiny_path_builds_once_into_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MMGRPO_CACHE", str(tmp_path))
    calls = []

    def fake_build(kind, directory, seed=0):
        calls.append(kind)
        Path(directory).mkdir(parents=True, exist_ok=True)
        (Path(directory) / "model_index.json").write_text("{}")
        return Path(directory)

    monkeypatch.setattr(tiny, "build_tiny_pipeline", fake_build)
    first = tiny_path("sd3")
    name = f"sd3-v{tiny.FORMAT_VERSION}-diffusers{diffusers.__version__}-transformers{transformers.__version__}"
    assert first == tmp_path / "tiny" / name and (first / "model_index.json").is_file()
    assert tiny_path("sd3") == first and calls == ["sd3"]
    assert [p.name for p in (tmp_path / "tiny").iterdir()] == [first.name]  # no staging folder left behind
    with pytest.raises(ValueError, match="unknown tiny pipeline kind"):
        tiny_path("sdxl")


def test_tiny_path_loses_a_race_gracefully_and_never_leaves_a_partial_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("MMGRPO_CACHE", str(tmp_path))
    final = tiny.cache_folder("flux")

    def racing_build(kind, directory, seed=0):
        final.mkdir(parents=True)  # another process finishes first
        (final / "model_index.json").write_text('{"winner": true}')
        (Path(directory) / "model_index.json").write_text("{}")
        return Path(directory)

    monkeypatch.setattr(tiny, "build_tiny_pipeline", racing_build)
    assert tiny_path("flux") == final and json.loads((final / "model_index.json").read_text()) == {"winner": True}
    assert os.listdir(tmp_path / "tiny") == [final.name]

    def failing_build(kind, directory, seed=0):
        (Path(directory) / "half-written").write_text("x")
        raise RuntimeError("disk full")

    monkeypatch.setattr(tiny, "build_tiny_pipeline", failing_build)
    with pytest.raises(RuntimeError, match="disk full"):
        tiny_path("wan")
    assert os.listdir(tmp_path / "tiny") == [final.name]
