"""Tests of the flow model adapters (pipelines/flow/adapters.py) on the tiny real-format pipelines."""

from __future__ import annotations

import json
import warnings

import diffusers
import pytest
import torch
from perturb import perturbed, restored, trainable

from mmgrpo.config import ConfigError
from mmgrpo.pipelines.flow import adapters as adapters_module
from mmgrpo.pipelines.flow.adapters import (
    AttentionFallbackWarning,
    FluxAdapter,
    PromptEmbeds,
    SD3Adapter,
    WanAdapter,
    check_autocast,
    load_adapter,
)
from mmgrpo.pipelines.flow.config import FlowModelConfig
from mmgrpo.pipelines.flow.tiny import KINDS, tiny_path
from mmgrpo.registry import MODEL_ADAPTERS

GUIDANCE = {"sd3": 4.5, "flux": 3.5, "wan": 5.0}
"""Guidance per kind: true CFG for SD3 and Wan, the guidance embedding for FLUX.1-dev-like tiny FLUX."""
FRAMES = 5
LATENT_SHAPES = {"sd3": (16, 8, 8), "flux": (16, 64), "wan": (16, 2, 8, 8)}
"""Per-row latent shapes at 64x64 (and 5 frames for Wan)."""


def tiny_cfg(kind: str, **overrides) -> FlowModelConfig:
    return FlowModelConfig(**{"type": kind, "path": f"tiny:{kind}", "lora_rank": 4, "lora_alpha": 8, **overrides})


@pytest.fixture(scope="module")
def adapter_of(tiny_cache):
    """``adapter_of(kind)``: one LoRA (rank 4, alpha 8) adapter per kind for the whole module. Tests that change
    its weights restore them (see :func:`perturbed`)."""
    built = {}

    def get(kind: str):
        if kind not in built:
            built[kind] = load_adapter(tiny_cfg(kind))
        return built[kind]

    return get


def inputs(adapter, n: int, seed: int = 0):
    """(latents, sigma) for n rows at 64x64 (5 frames for Wan)."""
    gen = torch.Generator().manual_seed(seed)
    x = adapter.initial_latents(n, 64, 64, FRAMES, gen)
    return x, torch.rand(n, generator=gen) * 0.9 + 0.05


# ---------------------------------------------------------------------------------------------------------------


def test_registry_and_prompt_embeds_rows():
    assert MODEL_ADAPTERS.get("sd3") is SD3Adapter and MODEL_ADAPTERS.get("flux") is FluxAdapter
    assert MODEL_ADAPTERS.get("wan") is WanAdapter and MODEL_ADAPTERS.entry("wan").info["modality"] == "video"
    cond = {"encoder_hidden_states": torch.arange(24.0).reshape(4, 3, 2), "pooled_projections": torch.arange(8.0)
            .reshape(4, 2)}
    e = PromptEmbeds(cond, {k: v + 100 for k, v in cond.items()})
    assert len(e) == 4
    part = e.select([3, 1])
    assert torch.equal(part.cond["pooled_projections"], cond["pooled_projections"][[3, 1]])
    assert torch.equal(part.uncond["encoder_hidden_states"], cond["encoder_hidden_states"][[3, 1]] + 100)
    whole = PromptEmbeds.cat([e.select(torch.tensor([0, 1])), e.select([2, 3])])
    assert all(torch.equal(whole.cond[k], cond[k]) for k in cond) and len(whole) == 4
    with pytest.raises(ValueError, match="unconditional"):
        PromptEmbeds.cat([e, PromptEmbeds(cond)])


@pytest.mark.parametrize("kind", KINDS)
def test_encode_runs_each_text_encoder_once_per_distinct_prompt(kind, adapter_of):
    ad = adapter_of(kind)
    encoders = {n: m for n, m in ad.pipe.components.items() if n.startswith("text_encoder") and m is not None}
    calls = dict.fromkeys(encoders, 0)
    hooks = [m.register_forward_hook(lambda *_, n=n: calls.__setitem__(n, calls[n] + 1)) for n, m in encoders.items()]
    try:
        prompts = [f"{kind} encode test one", f"{kind} encode test two", f"{kind} encode test one"]
        e = ad.encode(prompts, f"{kind} negative", GUIDANCE[kind])
        distinct = 2 if kind == "flux" else 3  # FLUX.1-dev-like: guidance embedding, no negative prompt
        assert calls == dict.fromkeys(encoders, distinct)
        again = ad.encode(prompts[1::-1], f"{kind} negative", GUIDANCE[kind])  # [two, one]
        assert calls == dict.fromkeys(encoders, distinct)  # all from the cache
    finally:
        for h in hooks:
            h.remove()
    assert len(e) == 3
    for k, v in e.cond.items():
        assert v.dtype == ad.dtype and v.device == ad.device and v.shape[0] == 3
        assert torch.equal(v[0], v[2]) and not torch.equal(v[0], v[1]) and torch.equal(again.cond[k], v[[1, 0]])
    if kind == "flux":
        assert e.uncond is None and not ad.uses_cfg(GUIDANCE[kind])
    else:
        assert e.uncond.keys() == e.cond.keys() and all(torch.equal(v[0], v[1]) for v in e.uncond.values())
    assert ad.encode(prompts, "", 1.0).uncond is None


@pytest.mark.parametrize("kind", KINDS)
def test_noise_sigmas_velocity_and_decode_match_the_stock_pipeline(kind, adapter_of):
    """One real pipeline call, with the transformer's inputs and outputs recorded, pins every convention: the
    initial noise for a seed, the sigma schedule, the sigma -> timestep conversion, the text embeddings, the CFG
    combination and the VAE scaling."""
    ad, g = adapter_of(kind), GUIDANCE[kind]
    calls = []

    def record(module, args, kwargs, output):
        calls.append((kwargs["hidden_states"].clone(), kwargs["timestep"].clone(), output[0].clone()))

    call = dict(prompt="a red cube", num_inference_steps=3, height=64, width=64, guidance_scale=g,
                max_sequence_length=ad.max_sequence_length, return_dict=False,
                **({"num_frames": FRAMES} if kind == "wan" else {}))
    hook = ad.transformer.register_forward_hook(record, with_kwargs=True)
    try:
        final = ad.pipe(**call, generator=torch.Generator().manual_seed(7), output_type="latent")[0]
    finally:
        hook.remove()
    pixels = ad.pipe(**call, generator=torch.Generator().manual_seed(7), output_type="pt")[0]

    sigmas = ad.sigmas(3, 64, 64, FRAMES)
    assert sigmas.dtype == torch.float32 and sigmas.shape == (4,) and sigmas[-1] == 0
    assert torch.equal(sigmas, ad.pipe.scheduler.sigmas.float()) and (sigmas.diff() < 0).all()

    noise = ad.initial_latents(1, 64, 64, FRAMES, torch.Generator().manual_seed(7))
    assert noise.dtype == torch.float32 and noise.shape == (1, *LATENT_SHAPES[kind])
    assert ad.initial_latents(3, 64, 64, FRAMES, None).shape == (3, *LATENT_SHAPES[kind])
    assert torch.equal(noise[0], calls[0][0][0])

    embeds = ad.encode(["a red cube"], "", g)
    if kind == "sd3":  # one batched forward: rows [uncond, cond]
        t_pipe, (v_u, v_c) = calls[0][1][0], calls[0][2]
        expected, sigma = v_u + g * (v_c - v_u), sigmas[0]
    elif kind == "flux":  # guidance-distilled: one forward
        t_pipe, expected, sigma = calls[0][1][0], calls[0][2][0], sigmas[0]
    else:  # separate cond and uncond forwards; UniPC passes whole-number timesteps
        t_pipe, v_c, v_u = calls[0][1][0], calls[0][2][0], calls[1][2][0]
        expected, sigma = v_u + g * (v_c - v_u), t_pipe.float() / 1000
    torch.testing.assert_close(ad.timestep(sigma.reshape(1))[0], t_pipe.float(), rtol=1e-6, atol=1e-4)
    with torch.no_grad():
        v = ad.velocity(noise, sigma.reshape(1), embeds, g)
    assert v.dtype == torch.float32 and v.shape == noise.shape
    torch.testing.assert_close(v[0], expected, rtol=1e-4, atol=1e-4)

    images = ad.decode(final)
    assert images.dtype == torch.float32 and images.min() >= 0 and images.max() <= 1
    assert images.shape == ((1, FRAMES, 3, 64, 64) if kind == "wan" else (1, 3, 64, 64))
    torch.testing.assert_close(images, pixels, rtol=1e-4, atol=1e-4)


def euler_rollout(ad, prompts, height, width, steps, g, seed, negative=""):
    """Final latents of the zero-noise rollout (ODE Euler, x + (sigma_next - sigma) * v) from the adapter's noise,
    schedule and velocity: what diffusers' FlowMatchEulerDiscreteScheduler computes."""
    sigmas = ad.sigmas(steps, height, width)
    x = ad.initial_latents(len(prompts), height, width, 1, torch.Generator().manual_seed(seed))
    e = ad.encode(prompts, negative, g)
    with torch.no_grad():
        for i in range(steps):
            x = x + (sigmas[i + 1] - sigmas[i]) * ad.velocity(x, sigmas[i].expand(len(prompts)), e, g)
    return x


@pytest.mark.parametrize("kind", ["sd3", "flux"])
def test_a_zero_noise_rollout_of_a_non_square_batch_is_the_stock_pipeline_output(kind, adapter_of):
    """Every step, not only the first: the schedule (FLUX's mu from the packed sequence length), the timesteps and
    FLUX's image ids and packing of a non-square image, for two prompts drawn from one generator."""
    ad, g, prompts = adapter_of(kind), GUIDANCE[kind], ["a red cube", "a blue sphere"]
    ours = euler_rollout(ad, prompts, 64, 128, 4, g, seed=11)
    stock = ad.pipe(prompt=prompts, num_inference_steps=4, height=64, width=128, guidance_scale=g,
                    max_sequence_length=ad.max_sequence_length, generator=torch.Generator().manual_seed(11),
                    output_type="latent", return_dict=False)[0]
    assert ours.shape == stock.shape == ((2, 16, 8, 16) if kind == "sd3" else (2, 32, 64))
    torch.testing.assert_close(ours, stock.float(), rtol=1e-4, atol=1e-4)
    assert not torch.allclose(ours[0], ours[1], atol=1e-2)


def test_flux_without_guidance_embedding_is_the_stock_pipeline_with_true_cfg(tiny_cache, tmp_path):
    """A FLUX model without a guidance embedding (FLUX.1-schnell's layout) takes guidance_scale > 1 as true CFG:
    FluxPipeline(true_cfg_scale=g, negative_prompt=...)."""
    pipe = diffusers.FluxPipeline.from_pretrained(tiny_path("flux"), dtype=torch.float32)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        transformer = diffusers.FluxTransformer2DModel(**{**pipe.transformer.config, "guidance_embeds": False})
    pipe.register_modules(transformer=transformer)
    pipe.save_pretrained(tmp_path)
    ad = load_adapter(tiny_cfg("flux", path=str(tmp_path)))
    assert not ad.guidance_embeds and ad.uses_cfg(3.5) and not ad.uses_cfg(1.0)
    ours = euler_rollout(ad, ["a red cube"], 64, 64, 3, 3.5, seed=5, negative="blurry")
    stock = ad.pipe(prompt="a red cube", negative_prompt="blurry", true_cfg_scale=3.5, num_inference_steps=3,
                    height=64, width=64, max_sequence_length=ad.max_sequence_length,
                    generator=torch.Generator().manual_seed(5), output_type="latent", return_dict=False)[0]
    torch.testing.assert_close(ours, stock, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", ["sd3", "flux", "wan"])
def test_a_transformer_in_bf16_takes_the_fp32_inputs(kind, adapter_of):
    """DeepSpeed's bf16 casts the weights it trains, not the adapter's inputs (no autocast), and every forward
    stopped on "Input type (float) and bias type (BFloat16)"; the inputs follow the weights' dtype, so a bf16
    copy and the fp32 model (a full fine-tune's frozen reference) both run, and agree to bf16 rounding."""
    import copy

    ad, g = adapter_of(kind), GUIDANCE[kind]
    x, sigma = inputs(ad, 2)
    e = ad.encode(["bf16 one", "bf16 two"], "", g)
    half = copy.deepcopy(ad.transformer).to(torch.bfloat16)
    with torch.no_grad():
        v_half = ad.velocity(x, sigma, e, g, transformer=half)
        v = ad.velocity(x, sigma, e, g)
    assert v_half.dtype == v.dtype == torch.float32
    assert (v_half - v).abs().max() <= 0.05 * v.abs().max()


@pytest.mark.parametrize("kind", ["sd3", "wan"])
def test_cfg_is_the_manual_combination_and_the_unconditional_branch_carries_no_grad(kind, adapter_of):
    ad, g = adapter_of(kind), GUIDANCE[kind]
    x, sigma = inputs(ad, 3)
    e = ad.encode(["cfg one", "cfg two", "cfg one"], "cfg negative", g)
    grad_modes = []
    hook = ad.transformer.register_forward_hook(lambda *_: grad_modes.append(torch.is_grad_enabled()))
    with perturbed(ad):
        try:
            v = ad.velocity(x, sigma, e, g)
        finally:
            hook.remove()
        assert grad_modes == [True, False]  # conditional under grad, unconditional under no_grad
        v_c = ad.velocity(x, sigma, PromptEmbeds(e.cond), 1.0)
        with torch.no_grad():
            v_u = ad.velocity(x, sigma, PromptEmbeds(e.uncond), 1.0)
        assert torch.equal(v, v_u + g * (v_c - v_u))

        weights = torch.randn(v.shape, generator=torch.Generator().manual_seed(1))
        params = trainable(ad)
        grads = torch.autograd.grad((v * weights).sum(), params)
        cond_grads = torch.autograd.grad((v_c * weights).sum(), params)
        assert any(c.abs().sum() > 0 for c in cond_grads)
        for got, want in zip(grads, cond_grads):  # an undetached v_u would add (1 - g) * its own gradient
            torch.testing.assert_close(got, g * want, rtol=1e-4, atol=1e-5 * g * want.abs().max().item())


@pytest.mark.parametrize("kind", ["sd3", "wan"])
def test_a_kept_unconditional_velocity_gives_the_same_guided_velocity_in_one_forward(kind, adapter_of):
    ad, g = adapter_of(kind), GUIDANCE[kind]
    x, sigma = inputs(ad, 3)
    e = ad.encode(["kept one", "kept two", "kept one"], "kept negative", g)
    with perturbed(ad):
        uncond = ad.unconditional_velocity(x, sigma, e, g)
        assert not uncond.requires_grad
        forwards = []
        hook = ad.transformer.register_forward_hook(lambda *_: forwards.append(1))
        try:
            v = ad.velocity(x, sigma, e, g, uncond=uncond)
        finally:
            hook.remove()
        assert len(forwards) == 1 and v.requires_grad
        assert torch.equal(v, ad.velocity(x, sigma, e, g))
    assert ad.unconditional_velocity(x, sigma, PromptEmbeds(e.cond), 1.0) is None  # no CFG


@pytest.mark.parametrize("kind", ["sd3", "wan"])
def test_fused_cfg_is_one_forward_of_both_branches_and_refuses_grad(kind, adapter_of):
    ad, g = adapter_of(kind), GUIDANCE[kind]
    x, sigma = inputs(ad, 3)
    e = ad.encode(["fused one", "fused two", "fused one"], "fused negative", g)
    rows = []
    hook = ad.transformer.register_forward_hook(lambda _m, args, kw, _out: rows.append(kw["hidden_states"].shape[0]),
                                                with_kwargs=True)
    with torch.no_grad(), perturbed(ad):
        try:
            fused = ad.velocity(x, sigma, e, g, fused_cfg=True)
        finally:
            hook.remove()
        split = ad.velocity(x, sigma, e, g)
    assert rows == [6]  # [cond; uncond] in one call
    torch.testing.assert_close(fused, split, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(fused, ad.velocity(x, sigma, PromptEmbeds(e.cond), 1.0).detach(), atol=1e-3)
    with pytest.raises(RuntimeError, match="no_grad"):
        ad.velocity(x, sigma, e, g, fused_cfg=True)


def test_guidance_distilled_flux_embeds_the_scale_in_one_forward(adapter_of):
    ad = adapter_of("flux")
    assert ad.guidance_embeds and ad.timestep(torch.tensor([0.25])).item() == 0.25
    x, sigma = inputs(ad, 2)
    e = ad.encode(["flux guidance"] * 2, "", 3.5)
    forwards = []
    hook = ad.transformer.register_forward_hook(lambda *_: forwards.append(1))
    try:
        with torch.no_grad():
            v35, v1 = ad.velocity(x, sigma, e, 3.5), ad.velocity(x, sigma, e, 1.0)
    finally:
        hook.remove()
    assert len(forwards) == 2 and not torch.allclose(v35, v1)


@pytest.mark.parametrize("kind", KINDS)
def test_velocity_is_bitwise_reproducible_for_the_same_batch_composition(kind, adapter_of):
    ad = adapter_of(kind)
    x, sigma = inputs(ad, 6, seed=3)
    e = ad.encode([f"row {i % 3}" for i in range(6)], "", GUIDANCE[kind])
    rows = torch.arange(2, 5)
    with torch.no_grad():
        first = ad.velocity(x[rows], sigma[rows], e.select(rows), GUIDANCE[kind])
        second = ad.velocity(x[2:5].clone(), sigma[2:5].clone(), e.select([2, 3, 4]), GUIDANCE[kind])
    assert torch.equal(first, second)


@pytest.mark.parametrize("kind", KINDS)
def test_lora_starts_at_the_base_model_and_the_reference_stays_there(kind, adapter_of):
    ad = adapter_of(kind)
    params = trainable(ad)
    assert params and all(p.dtype == torch.float32 and "lora" in n
                          for n, p in ad.transformer.named_parameters() if p.requires_grad)
    frozen = [m for n, m in ad.pipe.components.items() if n.startswith(("text_encoder", "vae")) and m is not None]
    assert not any(p.requires_grad for m in frozen for p in m.parameters())
    x, sigma = inputs(ad, 2)
    e = ad.encode(["lora a", "lora b"], "", GUIDANCE[kind])
    with torch.no_grad():
        v0, r0 = ad.velocity(x, sigma, e, GUIDANCE[kind]), ad.reference_velocity(x, sigma, e, GUIDANCE[kind])
    assert torch.equal(v0, r0)  # B = 0 at init: the policy is the base model
    with perturbed(ad):
        with torch.no_grad():
            v1 = ad.velocity(x, sigma, e, GUIDANCE[kind])
        r1 = ad.reference_velocity(x, sigma, e, GUIDANCE[kind])
        assert not torch.allclose(v1, r1, atol=1e-4) and torch.equal(r1, r0) and not r1.requires_grad
        assert all(p.requires_grad for p in params)  # switching the adapters off and on keeps them trainable


def assert_same_tensors(a, b):
    from safetensors.torch import load_file

    left, right = load_file(a), load_file(b)
    assert left.keys() == right.keys() and all(torch.equal(left[k], right[k]) for k in left)


@pytest.mark.parametrize("kind", KINDS)
def test_saved_lora_loads_in_stock_diffusers_and_back(kind, adapter_of, tmp_path):
    ad = adapter_of(kind)
    x, sigma = inputs(ad, 2)
    e = ad.encode(["saved lora a", "saved lora b"], "", 1.0)
    t = ad.timestep(sigma)
    with perturbed(ad, seed=5):
        ad.save_trainable(tmp_path)
        trained = [p.detach().clone() for p in trainable(ad)]
        with torch.no_grad():
            want = ad._forward(ad.transformer, x, t, e.cond, GUIDANCE[kind])
    assert [p.name for p in tmp_path.iterdir()] == ["pytorch_lora_weights.safetensors"]
    with perturbed(ad, seed=5):  # a sharded model saves from its gathered state dict: the same file
        ad.save_trainable(tmp_path / "gathered", state_dict=ad.transformer.state_dict())
    assert_same_tensors(tmp_path / "pytorch_lora_weights.safetensors",
                        tmp_path / "gathered" / "pytorch_lora_weights.safetensors")

    pipe = getattr(diffusers, ad.pipeline_class).from_pretrained(tiny_path(kind), dtype=torch.float32)
    with torch.no_grad():
        base = ad._forward(pipe.transformer, x, t, e.cond, GUIDANCE[kind])
        pipe.load_lora_weights(tmp_path)
        got = ad._forward(pipe.transformer, x, t, e.cond, GUIDANCE[kind])
    assert not torch.allclose(base, want, atol=1e-3)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

    with restored(ad):
        ad.load_trainable(tmp_path)
        assert all(torch.equal(p, q) for p, q in zip(trainable(ad), trained))


WIDE_TARGETS = {
    "sd3": ["attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj",
            "attn.add_v_proj", "attn.to_add_out", "ff.net.0.proj", "ff.net.2"],
    "flux": ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "to_add_out", "ff_context.net.2", "proj_mlp",
             "proj_out"],
    "wan": ["to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj", "ffn.net.2"],
}
"""Per-family widened LoRA targets, as docs/flow_models.md names them (FLUX's proj_out is the single blocks' and
the final projection)."""


@pytest.mark.parametrize("kind", KINDS)
def test_widened_lora_targets_load_in_stock_diffusers(kind, tiny_cache, tmp_path):
    ad = load_adapter(tiny_cfg(kind, lora_targets=WIDE_TARGETS[kind]))
    wrapped = {n.split(".lora_A")[0] for n, _ in ad.transformer.named_parameters() if ".lora_A." in n}
    assert all(any(n.endswith(f".{t}") for n in wrapped) for t in WIDE_TARGETS[kind])
    x, sigma = inputs(ad, 1)
    e, t = ad.encode(["wide lora"], "", 1.0), ad.timestep(sigma)
    with perturbed(ad, seed=3), torch.no_grad():
        ad.save_trainable(tmp_path)
        want = ad._forward(ad.transformer, x, t, e.cond, GUIDANCE[kind])
    pipe = getattr(diffusers, ad.pipeline_class).from_pretrained(tiny_path(kind), dtype=torch.float32)
    pipe.load_lora_weights(tmp_path)
    with torch.no_grad():
        got = ad._forward(pipe.transformer, x, t, e.cond, GUIDANCE[kind])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("key", "config_key", "saved", "current"), [("lora_alpha", "lora_alpha", 16, 8),
                                                                     ("r", "lora_rank", 8, 4)])
def test_a_lora_file_of_another_alpha_or_rank_is_refused_by_name(key, config_key, saved, current, adapter_of,
                                                                 tmp_path):
    """The file's adapter config (diffusers' safetensors metadata) says what it was trained with: another alpha
    scales the same weights differently (it loaded silently), another rank has other shapes."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    ad = adapter_of("sd3")  # rank 4, alpha 8
    ad.save_trainable(tmp_path)
    file = tmp_path / adapters_module.LORA_WEIGHT_NAME
    with safe_open(str(file), "pt") as f:
        metadata, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    config = json.loads(metadata["lora_adapter_metadata"])
    assert config[f"transformer.{key}"] == current
    config[f"transformer.{key}"] = saved
    save_file(tensors, file, metadata={**metadata, "lora_adapter_metadata": json.dumps(config)})
    with restored(ad), pytest.raises(ValueError, match=rf"{config_key} {saved}, .* 'model.{config_key}' is {current}"):
        ad.load_trainable(tmp_path)


def test_full_fine_tune_trains_everything_saves_a_transformer_folder_and_keeps_a_reference(tiny_cache, tmp_path):
    ad = load_adapter(tiny_cfg("sd3", lora_rank=0), keep_reference=True)
    params = list(ad.transformer.parameters())
    assert len(trainable(ad)) == len(params) and all(p.dtype == torch.float32 for p in params)
    x, sigma = inputs(ad, 2)
    e = ad.encode(["full a", "full b"], "", 4.5)
    with torch.no_grad():
        r0 = ad.reference_velocity(x, sigma, e, 4.5)
        assert torch.equal(ad.velocity(x, sigma, e, 4.5), r0)
        ad.transformer.proj_out.weight.add_(0.05)
        assert not torch.allclose(ad.velocity(x, sigma, e, 4.5), r0, atol=1e-4)
        assert torch.equal(ad.reference_velocity(x, sigma, e, 4.5), r0)

    ad.save_trainable(tmp_path)
    ad.save_trainable(tmp_path / "gathered", state_dict=ad.transformer.state_dict())  # as under FSDP / ZeRO-3
    folders = [tmp_path / "transformer", tmp_path / "gathered" / "transformer"]
    assert_same_tensors(*(d / "diffusion_pytorch_model.safetensors" for d in folders))
    assert json.loads((folders[0] / "config.json").read_text()) == json.loads((folders[1] / "config.json").read_text())
    loaded = diffusers.SD3Transformer2DModel.from_pretrained(tmp_path / "transformer")
    t = ad.timestep(sigma)
    with torch.no_grad():
        torch.testing.assert_close(ad._forward(loaded, x, t, e.cond, 4.5),
                                   ad._forward(ad.transformer, x, t, e.cond, 4.5), rtol=1e-5, atol=1e-5)
        saved = ad.transformer.proj_out.weight.clone()
        ad.transformer.proj_out.weight.zero_()
    ad.load_trainable(tmp_path)
    assert torch.equal(ad.transformer.proj_out.weight, saved) and ad.transformer.proj_out.weight.requires_grad

    ad._reference = None  # as if built without keep_reference=True
    with pytest.raises(RuntimeError, match="keep_reference=True"):
        ad.reference_velocity(x, sigma, e, 4.5)


def test_gradient_checkpointing_recomputes_and_gives_the_same_gradients(tiny_cache):
    ad = load_adapter(tiny_cfg("flux", gradient_checkpointing=True))
    assert ad.transformer.is_gradient_checkpointing
    x, sigma = inputs(ad, 2)
    e = ad.encode(["checkpointed a", "checkpointed b"], "", 3.5)
    block_runs = []
    # torch stops the recomputation early, before the block's own forward hook, so watch a layer inside it
    hook = ad.transformer.transformer_blocks[0].attn.to_q.register_forward_hook(lambda *_: block_runs.append(1))

    def grads():
        block_runs.clear()
        loss = ad.velocity(x, sigma, e, 3.5).square().mean()
        return torch.autograd.grad(loss, trainable(ad)), len(block_runs)

    with perturbed(ad):
        with_ckpt, runs_ckpt = grads()
        ad.transformer.disable_gradient_checkpointing()
        without, runs_plain = grads()
    hook.remove()
    assert (runs_ckpt, runs_plain) == (2, 1)  # the block ran again in backward
    for a, b in zip(with_ckpt, without):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_bfloat16_base_with_fp32_lora(tiny_cache):
    ad = load_adapter(tiny_cfg("wan", dtype="bfloat16"))
    assert ad.dtype == torch.bfloat16 and ad.pipe.vae.dtype == torch.bfloat16
    assert all(p.dtype == torch.float32 for p in trainable(ad))
    assert ad.transformer.proj_out.weight.dtype == torch.bfloat16
    x, sigma = inputs(ad, 2)
    e = ad.encode(["bf16 a", "bf16 b"], "", 5.0)
    assert e.cond["encoder_hidden_states"].dtype == torch.bfloat16
    with perturbed(ad):
        v = ad.velocity(x, sigma, e, 5.0)
        assert v.dtype == torch.float32 and torch.isfinite(v).all()
        v.square().mean().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in trainable(ad))


@pytest.mark.parametrize("kind", ["flux", "sd3"])  # diffusers backend dispatch (FLUX) and SDPA processors (SD3)
def test_unavailable_attention_backend_warns_once_and_falls_back_to_sdpa(kind, adapter_of, monkeypatch):
    monkeypatch.setattr(adapters_module, "_warned", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ad = load_adapter(tiny_cfg(kind, attention_backend="xformers"))
        assert ad._set_attention_backend(ad.transformer, "xformers") == "native"  # asked again: no new warning
    fallbacks = [w for w in caught if issubclass(w.category, AttentionFallbackWarning)]
    assert len(fallbacks) == 1 and "xformers" in str(fallbacks[0].message)
    assert "\n" not in str(fallbacks[0].message) and ad.attention_backend == "native"
    native = adapter_of(kind)
    assert native.attention_backend == "native"
    x, sigma = inputs(ad, 2)
    with torch.no_grad():
        got = ad.velocity(x, sigma, ad.encode(["attention"] * 2, "", GUIDANCE[kind]), GUIDANCE[kind])
        want = native.velocity(x, sigma, native.encode(["attention"] * 2, "", GUIDANCE[kind]), GUIDANCE[kind])
    assert torch.equal(got, want)


@pytest.mark.parametrize(
    ("overrides", "key", "fragment"),
    [
        ({"type": "sd4"}, "'model.type'", "did you mean 'sd3'"),
        ({"path": "/nonexistent/sd3-folder"}, "'model.path'", "/nonexistent/sd3-folder"),
        ({"path": "./no-such-model"}, "'model.path'", "./no-such-model"),
        ({"path": "tiny:sdxl"}, "'model.path'", "tiny:sd3"),
        ({"path": "stabilityai/stable-diffusion-3.5-medium"}, "'model.path'", "stabilityai/stable-diffusion-3.5-medium"),
        ({"type": "wan"}, "'model.path'", "holds a StableDiffusion3Pipeline"),
        ({"dtype": "float64"}, "'model.dtype'", "bfloat16"),
        ({"lora_rank": -1}, "'model.lora_rank'", "-1"),
        ({"attention_backend": "fastest"}, "'model.attention_backend'", "xformers"),
    ],
)
def test_bad_config_is_a_one_line_config_error_naming_the_key(overrides, key, fragment, tiny_cache):
    with pytest.raises(ConfigError) as err:
        load_adapter(tiny_cfg("sd3", **{"path": "tiny:sd3", **overrides}))
    message = str(err.value)
    assert key in message and fragment in message and "\n" not in message


def test_other_bad_inputs_name_their_keys(tmp_path, adapter_of, tiny_cache):
    with pytest.raises(ConfigError, match=r"'model.path'.*no model_index.json"):
        load_adapter(tiny_cfg("sd3", path=str(tmp_path)))
    with pytest.raises(ConfigError, match=r"'model.path': local model folder not found: \./no-such-folder \(looked "
                                          r"for under the working directory "):
        load_adapter(tiny_cfg("sd3", path="./no-such-folder"))
    with pytest.raises(ConfigError, match=r"'model.lora_targets'"):
        load_adapter(tiny_cfg("wan", lora_targets=["no_such_layer"]))
    with pytest.raises(ConfigError, match=r"'sampling.height'"):
        adapter_of("sd3").initial_latents(1, 60, 64, 1, None)
    with pytest.raises(ConfigError, match=r"'sampling.num_frames'"):
        adapter_of("wan").initial_latents(1, 64, 64, 4, None)
    if "qwen2_vl" in MODEL_ADAPTERS:
        with pytest.raises(ConfigError, match=r"'model.type'.*not a flow model adapter"):
            load_adapter(tiny_cfg("qwen2_vl"))


@pytest.mark.parametrize(("kind", "targets", "missing", "hint"), [
    ("wan", ["to_q", "to_v", "ff.net.0.proj"], "ff.net.0.proj", "ffn.net.0.proj"),  # Wan's FFN is ffn.*
    ("sd3", ["to_q", "proj_mlp"], "proj_mlp", "attn.to_q"),  # FLUX's single-block MLP: SD3 has none
    ("flux", [], "empty", "attn.add_q_proj"),
])
def test_a_lora_target_that_matches_no_module_is_a_config_error(kind, targets, missing, hint, tiny_cache):
    """PEFT stops only when no target matches: one that matches nothing beside valid ones trained fewer layers
    than asked, silently."""
    with pytest.raises(ConfigError) as err:
        load_adapter(tiny_cfg(kind, lora_targets=targets))
    message = str(err.value)
    assert "'model.lora_targets'" in message and missing in message and hint in message and "\n" not in message


def test_a_full_fine_tune_is_loaded_shard_by_shard_without_a_second_model(tmp_path):
    """load_full copies a sharded save_pretrained folder into the transformer in place: host memory grows by about
    a shard, not by a second model (from_pretrained builds one first: 48 GB for a 12B transformer in fp32)."""
    from mmgrpo.pipelines.flow.bench import _reset_peak_rss, _status_mib

    model = diffusers.SD3Transformer2DModel(sample_size=16, patch_size=2, in_channels=4, num_layers=4,
                                            attention_head_dim=64, num_attention_heads=8, joint_attention_dim=512,
                                            caption_projection_dim=512, pooled_projection_dim=64, out_channels=4)
    model_mib = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    model.save_pretrained(tmp_path / "transformer", max_shard_size="16MB")
    assert (tmp_path / "transformer" / "diffusion_pytorch_model.safetensors.index.json").is_file()
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    before = _status_mib("VmRSS")
    if before is None or not _reset_peak_rss():
        pytest.skip("needs Linux /proc/self/status and clear_refs to measure the peak resident size")
    adapters_module.load_full(tmp_path / "transformer", model)
    growth = _status_mib("VmHWM") - before
    assert all(torch.equal(v, saved[k]) for k, v in model.state_dict().items())
    assert growth < 0.4 * model_mib, f"loading grew the process by {growth:.0f} MiB for a {model_mib:.0f} MiB model"

    other = diffusers.SD3Transformer2DModel(sample_size=16, patch_size=2, in_channels=4, num_layers=1,
                                            attention_head_dim=8, num_attention_heads=2, joint_attention_dim=16,
                                            caption_projection_dim=16, pooled_projection_dim=8, out_channels=4)
    with pytest.raises(ValueError, match=r"weights in .*transformer.* do not fit this SD3Transformer2DModel"):
        adapters_module.load_full(tmp_path / "transformer", other)
    other.save_pretrained(tmp_path / "small")
    with pytest.raises(ValueError, match=r"weights in .*small.* do not fit"):
        adapters_module.load_full(tmp_path / "small", model)
    with pytest.raises(FileNotFoundError, match="no diffusion_pytorch_model.safetensors"):
        adapters_module.load_full(tmp_path / "nothing", model)


@pytest.mark.parametrize("model_dtype, autocast, refused", [
    ("float16", torch.bfloat16, True), ("bfloat16", torch.float16, True),
    ("float16", torch.float16, False), ("bfloat16", torch.bfloat16, False), ("bfloat16", None, False),
    ("float32", torch.float16, False), ("float32", torch.bfloat16, False)])
def test_check_autocast_refuses_only_half_weights_under_the_other_half_type(model_dtype, autocast, refused):
    if refused:
        with pytest.raises(ConfigError, match=rf"^bad value for 'model.dtype': {model_dtype} cannot run under "):
            check_autocast(model_dtype, autocast)
    else:
        check_autocast(model_dtype, autocast)
