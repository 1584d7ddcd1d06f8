"""Wan2.2 in the Wan adapter: the two-expert A14B layout (``transformer`` / ``transformer_2`` switched at
``boundary_ratio``) and TI2V-5B's per-token timesteps (``expand_timesteps``), on tiny WanPipeline folders built
from config, saved with ``save_pretrained`` and loaded through the adapter."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch
from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel
from perturb import perturbed, restored, trainable
from random_flow import RANDOM_TINY_SD3
from safetensors.torch import load_file
from transformers import UMT5Config, UMT5EncoderModel

from mmgrpo.config import ConfigError, load_config
from mmgrpo.pipelines.flow.adapters import LORA_WEIGHT_NAME, WanExperts, load_adapter
from mmgrpo.pipelines.flow.config import FlowModelConfig
from mmgrpo.pipelines.flow.policy import FlowPolicy
from mmgrpo.pipelines.flow.tiny import T5_DIM, _t5_kwargs, t5_tokenizer
from mmgrpo.trainer import Trainer

ROOT = Path(__file__).resolve().parents[2]
BOUNDARY_RATIO = 0.8
"""With UniPC's flow_shift 3 and 4 steps the sigmas are ~[1, 0.9, 0.75, 0.5]: two steps on each expert."""
G = 5.0
SIZE, FRAMES = 32, 5
LATENTS = {"a14b": (16, 2, 4, 4), "ti2v": (48, 2, 2, 2)}
"""Per-row latent shapes at 32x32 and 5 frames: Wan2.1's VAE (16 channels, 8x) and TI2V's (48 channels, 16x)."""


def _transformer(channels: int) -> WanTransformer3DModel:
    return WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=channels,
        out_channels=channels, text_dim=T5_DIM, freq_dim=32, ffn_dim=64, num_layers=2, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", rope_max_seq_len=64,
    )


def _pipeline(kind: str) -> WanPipeline:
    """A14B-like (two experts, boundary_ratio) or TI2V-5B-like (expand_timesteps, 48-channel residual VAE with
    16x spatial compression: 8x from three downsamplings and a 2x2 patch)."""
    tokenizer = t5_tokenizer()
    scheduler = UniPCMultistepScheduler(num_train_timesteps=1000, prediction_type="flow_prediction",
                                        use_flow_sigmas=True, flow_shift=3.0)
    parts = {"tokenizer": tokenizer, "scheduler": scheduler,
             "text_encoder": UMT5EncoderModel(UMT5Config(**_t5_kwargs(len(tokenizer))))}
    small = {"base_dim": 8, "dim_mult": [1, 2, 2, 2], "num_res_blocks": 1, "temperal_downsample": [False, True, True]}
    if kind == "a14b":
        return WanPipeline(transformer=_transformer(16), transformer_2=_transformer(16), boundary_ratio=BOUNDARY_RATIO,
                           vae=AutoencoderKLWan(z_dim=16, **small), **parts)
    stats = torch.linspace(-0.5, 0.5, 48)
    vae = AutoencoderKLWan(z_dim=48, is_residual=True, in_channels=12, out_channels=12, patch_size=2,
                           scale_factor_spatial=16, latents_mean=stats.tolist(), latents_std=(stats.abs() + 1).tolist(),
                           **small)
    return WanPipeline(transformer=_transformer(48), vae=vae, expand_timesteps=True, **parts)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """{"a14b": folder, "ti2v": folder}: the tiny pipelines, saved once per module."""
    out = {}
    for kind in ("a14b", "ti2v"):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            pipe = _pipeline(kind)
        out[kind] = tmp_path_factory.mktemp(kind)
        pipe.save_pretrained(out[kind], safe_serialization=True)
    return out


def cfg_of(folder: Path, **overrides) -> FlowModelConfig:
    return FlowModelConfig(**{"type": "wan", "path": str(folder), "lora_rank": 4, "lora_alpha": 8, **overrides})


@pytest.fixture(scope="module")
def lora(folders):
    """``lora(kind)``: one LoRA adapter per kind for the module (tests restore any weights they change)."""
    built = {}

    def get(kind: str):
        if kind not in built:
            built[kind] = load_adapter(cfg_of(folders[kind]))
        return built[kind]

    return get


def latents(adapter, n: int, seed: int = 0) -> torch.Tensor:
    return adapter.initial_latents(n, SIZE, SIZE, FRAMES, torch.Generator().manual_seed(seed))


@contextlib.contextmanager
def recording(modules: dict):
    """Yields a list that gets (name, hidden_states, timestep, output) of every forward of ``modules``."""
    calls = []
    hooks = [m.register_forward_hook(
        lambda _m, _args, kw, out, name=name: calls.append(
            (name, kw["hidden_states"].clone(), kw["timestep"].clone(), out[0].clone())), with_kwargs=True)
        for name, m in modules.items()]
    try:
        yield calls
    finally:
        for h in hooks:
            h.remove()


def assert_same_tensors(a: Path, b: Path) -> None:
    left, right = load_file(a), load_file(b)
    assert left.keys() == right.keys() and all(torch.equal(left[k], right[k]) for k in left)


def expert(part, x, timestep, embeds):
    """One expert called directly, as WanPipeline calls it."""
    with torch.no_grad():
        return part(hidden_states=x, timestep=timestep, encoder_hidden_states=embeds["encoder_hidden_states"],
                    return_dict=False)[0].float()


# ---------------------------------------------------------------------------------------------------------------
# Two experts (A14B)
# ---------------------------------------------------------------------------------------------------------------


def test_experts_switch_at_the_boundary_as_in_the_stock_pipeline(lora):
    ad = lora("a14b")
    assert isinstance(ad.transformer, WanExperts) and ad.transformer.boundary == pytest.approx(800.0)
    call = {"prompt": "a red cube", "num_inference_steps": 4, "height": SIZE, "width": SIZE, "num_frames": FRAMES,
            "guidance_scale": G, "max_sequence_length": ad.max_sequence_length, "output_type": "latent"}
    with recording(ad.parts) as stock:
        ad.pipe(**call, generator=torch.Generator().manual_seed(7))
    assert [c[0] for c in stock] == ["transformer"] * 4 + ["transformer_2"] * 4  # (cond, uncond) per step

    sigmas = ad.sigmas(4, SIZE, SIZE, FRAMES)
    assert torch.equal(sigmas, ad.pipe.scheduler.sigmas.float())
    embeds = ad.encode(["a red cube"], "", G)
    with recording(ad.parts) as ours, torch.no_grad():
        for step in range(4):
            (_, x, t, v_c), (_, _, _, v_u) = stock[2 * step], stock[2 * step + 1]
            v = ad.velocity(x.float(), t.float() / 1000, embeds, G)
            torch.testing.assert_close(v, v_u + G * (v_c - v_u), rtol=1e-4, atol=1e-4)
    assert [c[0] for c in ours] == [c[0] for c in stock]
    high = ad.transformer.high_noise(ad.timestep(sigmas[:-1]))  # the schedule the policy runs
    assert high.tolist() == [True, True, False, False]
    assert ad.transformer.high_noise(torch.tensor([800.0, 799.99])).tolist() == [True, False]  # t >= boundary


def test_experts_name_their_blocks_for_fsdp_wrapping(lora):
    """FSDP's transformer-based wrapping reads the root module's ``_no_split_modules`` and finds those classes
    in it (accelerate's own lookup): the two-expert module lists its experts' blocks."""
    from accelerate.utils.dataclasses import get_module_class_from_name
    from diffusers.models.transformers.transformer_wan import WanTransformerBlock

    experts = lora("a14b").transformer
    assert experts._no_split_modules == ["WanTransformerBlock"]
    assert get_module_class_from_name(experts, "WanTransformerBlock") is WanTransformerBlock


def test_synced_experts_run_what_any_process_needs_with_the_same_output(lora):
    """Under sharded weights (``synced``), an expert another process needs runs here too, and the rows still
    come from their own expert: high-noise rows give the same velocity through both experts."""
    ad = lora("a14b")
    x, e, sigma = latents(ad, 2), ad.encode(["synced a", "synced b"], "", 1.0), torch.tensor([0.9, 0.9])
    with recording(ad.parts) as calls, torch.no_grad():
        alone = ad.velocity(x, sigma, e, 1.0)
    assert [c[0] for c in calls] == ["transformer"]
    ad.transformer.synced = lambda need: True  # another process needs both experts
    try:
        with recording(ad.parts) as calls, torch.no_grad():
            synced = ad.velocity(x, sigma, e, 1.0)
    finally:
        ad.transformer.synced = None
    assert [c[0] for c in calls] == ["transformer", "transformer_2"]
    assert torch.equal(alone, synced)


def test_guidance_scale_2_guides_the_low_noise_expert_steps_as_the_stock_pipeline(folders, lora):
    g2 = 2.0
    ad = load_adapter(cfg_of(folders["a14b"], guidance_scale_2=g2))
    call = {"prompt": "a red cube", "num_inference_steps": 4, "height": SIZE, "width": SIZE, "num_frames": FRAMES,
            "guidance_scale": G, "guidance_scale_2": g2, "max_sequence_length": ad.max_sequence_length,
            "output_type": "latent"}
    with recording(ad.parts) as stock:
        ad.pipe(**call, generator=torch.Generator().manual_seed(7))
    embeds = ad.encode(["a red cube"], "", G)
    scales = []
    with torch.no_grad():
        for step in range(4):
            (_, x, t, v_c), (_, _, _, v_u) = stock[2 * step], stock[2 * step + 1]
            v = ad.velocity(x.float(), t.float() / 1000, embeds, G)
            scale = G if bool(ad.transformer.high_noise(t)) else g2
            torch.testing.assert_close(v, v_u + scale * (v_c - v_u), rtol=1e-4, atol=1e-4)
            scales.append(scale)
    assert scales == [G, G, g2, g2]

    x, e = latents(ad, 2), ad.encode(["mixed a", "mixed b"], "", G)  # per row in a mixed batch (a DanceGRPO replay)
    sigma = torch.tensor([0.9, 0.5])
    with torch.no_grad():
        v = ad.velocity(x, sigma, e, G)
        v_u = ad.unconditional_velocity(x, sigma, e, G)
        v_c = ad.velocity(x, sigma, e, 1.0)
    torch.testing.assert_close(v, v_u + torch.tensor([G, g2]).view(-1, 1, 1, 1, 1) * (v_c - v_u))
    with pytest.raises(ConfigError, match="'model.guidance_scale_2'"):
        load_adapter(cfg_of(folders["ti2v"], guidance_scale_2=g2))  # no low-noise expert


def test_guidance_scale_at_most_one_turns_cfg_off_for_both_experts_as_the_stock_pipeline(folders):
    """WanPipeline decides CFG on guidance_scale alone (do_classifier_free_guidance), so guidance_scale_2 > 1 then
    guides nothing; mmgrpo keeps that (documented on model.guidance_scale_2)."""
    ad = load_adapter(cfg_of(folders["a14b"], guidance_scale_2=3.0))
    call = {"prompt": "a red cube", "num_inference_steps": 4, "height": SIZE, "width": SIZE, "num_frames": FRAMES,
            "guidance_scale": 1.0, "guidance_scale_2": 3.0, "max_sequence_length": ad.max_sequence_length,
            "output_type": "latent"}
    with recording(ad.parts) as stock:
        ad.pipe(**call, generator=torch.Generator().manual_seed(7))
    assert [name for name, *_ in stock] == ["transformer"] * 2 + ["transformer_2"] * 2  # one forward per step
    embeds = ad.encode(["a red cube"], "", 1.0)
    assert embeds.uncond is None and not ad.uses_cfg(1.0)
    with torch.no_grad():
        for _, x, t, out in stock:
            torch.testing.assert_close(ad.velocity(x.float(), t.float() / 1000, embeds, 1.0), out.float(),
                                       rtol=1e-4, atol=1e-4)


def test_a_mixed_batch_takes_each_row_from_its_own_expert_at_the_full_batch_size(lora):
    ad = lora("a14b")
    x, e = latents(ad, 2), ad.encode(["mixed a", "mixed b"], "", 1.0)
    high, low = ad.parts["transformer"], ad.parts["transformer_2"]
    for sigma, ran in (([0.9, 0.9], ["transformer"]), ([0.5, 0.5], ["transformer_2"]),
                       ([0.9, 0.5], ["transformer", "transformer_2"])):
        sigma = torch.tensor(sigma)
        with recording(ad.parts) as calls, torch.no_grad():
            v = ad.velocity(x, sigma, e, 1.0)
        assert [c[0] for c in calls] == ran
        t = ad.timestep(sigma)
        want = [(high if s > BOUNDARY_RATIO else low) for s in sigma.tolist()]
        for row, part in enumerate(want):  # the expert on the whole batch, as in a rollout chunk
            assert torch.equal(v[row], expert(part, x, t, e.cond)[row])
    assert not torch.allclose(expert(high, x, t, e.cond), expert(low, x, t, e.cond), atol=1e-3)


def test_lora_on_both_experts_reference_and_gradients(lora):
    ad = lora("a14b")
    names = {n for n, p in ad.transformer.named_parameters() if p.requires_grad}
    assert ad.trained_parts == ("transformer", "transformer_2") and all("lora" in n for n in names)
    assert {n.split(".")[0] for n in names} == {"transformer", "transformer_2"}
    x, e = latents(ad, 2), ad.encode(["ref a", "ref b"], "", G)
    sigma = torch.tensor([0.9, 0.5])
    with torch.no_grad():
        assert torch.equal(ad.velocity(x, sigma, e, G), ad.reference_velocity(x, sigma, e, G))  # B = 0
        r0 = ad.reference_velocity(x, sigma, e, G)
    with perturbed(ad):
        for s in (0.9, 0.5):  # each expert's LoRA changes the rows it runs; the reference stays the base
            rows = torch.full((2,), s)
            with torch.no_grad():
                assert not torch.allclose(ad.velocity(x, rows, e, G), ad.reference_velocity(x, rows, e, G), atol=1e-4)
        assert torch.equal(ad.reference_velocity(x, sigma, e, G), r0)

        named = [(n, p) for n, p in ad.transformer.named_parameters() if p.requires_grad]
        loss = ad.velocity(x, torch.full((2,), 0.9), e, G).square().mean()  # the high-noise expert only
        grads = dict(zip((n for n, _ in named), torch.autograd.grad(loss, [p for _, p in named])))
    assert any(g.abs().sum() > 0 for n, g in grads.items() if n.startswith("transformer."))
    assert all(torch.equal(g, torch.zeros_like(g)) for n, g in grads.items() if n.startswith("transformer_2."))


def test_lora_of_both_experts_loads_in_stock_diffusers_and_back(lora, folders, tmp_path):
    ad = lora("a14b")
    x, e = latents(ad, 1), ad.encode(["saved lora"], "", 1.0)
    t = ad.timestep(torch.tensor([0.7]))
    with perturbed(ad, seed=5):
        ad.save_trainable(tmp_path / "lora")
        ad.save_trainable(tmp_path / "gathered", state_dict=ad.transformer.state_dict())  # as under FSDP
        trained = [p.detach().clone() for p in trainable(ad)]
        want = {n: expert(ad.parts[n], x, t, e.cond) for n in ad.parts}
    files = {LORA_WEIGHT_NAME, f"transformer_2/{LORA_WEIGHT_NAME}"}
    assert {str(p.relative_to(tmp_path / "lora")) for p in (tmp_path / "lora").rglob("*.safetensors")} == files
    for name in files:
        assert_same_tensors(tmp_path / "lora" / name, tmp_path / "gathered" / name)

    pipe = WanPipeline.from_pretrained(folders["a14b"], dtype=torch.float32)
    base = expert(pipe.transformer_2, x, t, e.cond)
    pipe.load_lora_weights(tmp_path / "lora")  # diffusers' default file: the high-noise expert
    pipe.load_lora_weights(tmp_path / "lora" / "transformer_2", load_into_transformer_2=True)
    assert not torch.allclose(base, want["transformer_2"], atol=1e-3)
    for name in ad.parts:
        torch.testing.assert_close(expert(getattr(pipe, name), x, t, e.cond), want[name], rtol=1e-5, atol=1e-5)

    with restored(ad):
        ad.load_trainable(tmp_path / "lora")
        assert all(torch.equal(p, q) for p, q in zip(trainable(ad), trained))


def test_lora_of_the_low_noise_expert_alone_cannot_load_into_the_high_noise_one(folders, tmp_path):
    """With only transformer_2 trained, its file sits in transformer_2/: a plain load_lora_weights(dir) finds no
    file (diffusers would otherwise take the only .safetensors there for transformer) and the subfolder loads."""
    ad = load_adapter(cfg_of(folders["a14b"]), train_experts="low")
    x, e = latents(ad, 1), ad.encode(["low only"], "", 1.0)
    t = ad.timestep(torch.tensor([0.3]))
    with perturbed(ad, seed=7):
        ad.save_trainable(tmp_path)
        want = expert(ad.parts["transformer_2"], x, t, e.cond)
    assert [str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*.safetensors")] == \
        [f"transformer_2/{LORA_WEIGHT_NAME}"]
    pipe = WanPipeline.from_pretrained(folders["a14b"], dtype=torch.float32)
    with pytest.raises((OSError, ValueError)):
        pipe.load_lora_weights(tmp_path)
    pipe.load_lora_weights(tmp_path / "transformer_2", load_into_transformer_2=True)
    torch.testing.assert_close(expert(pipe.transformer_2, x, t, e.cond), want, rtol=1e-5, atol=1e-5)
    assert not any("lora" in n for n, _ in pipe.transformer.named_parameters())


def test_full_fine_tune_of_both_experts_saves_two_loadable_folders(folders, tmp_path):
    ad = load_adapter(cfg_of(folders["a14b"], lora_rank=0), keep_reference=True)
    assert len(trainable(ad)) == len(list(ad.transformer.parameters()))
    x, e = latents(ad, 2), ad.encode(["full a", "full b"], "", G)
    sigma = torch.tensor([0.9, 0.5])
    with torch.no_grad():
        r0 = ad.reference_velocity(x, sigma, e, G)
        for part in ad.parts.values():
            part.proj_out.weight.add_(0.05)
        moved = ad.velocity(x, sigma, e, G)
        assert all(not torch.allclose(moved[i], r0[i], atol=1e-4) for i in range(2))
        assert torch.equal(ad.reference_velocity(x, sigma, e, G), r0)

    ad.save_trainable(tmp_path)
    t = ad.timestep(sigma)
    for name, part in ad.parts.items():
        loaded = WanTransformer3DModel.from_pretrained(tmp_path / name)
        assert torch.equal(expert(loaded, x, t, e.cond), expert(part, x, t, e.cond))
    ad.save_trainable(tmp_path / "gathered", state_dict=ad.transformer.state_dict())
    for name in ad.parts:
        file = f"{name}/diffusion_pytorch_model.safetensors"
        assert_same_tensors(tmp_path / file, tmp_path / "gathered" / file)
    saved = ad.parts["transformer_2"].proj_out.weight.detach().clone()
    with torch.no_grad():
        ad.parts["transformer_2"].proj_out.weight.zero_()
    ad.load_trainable(tmp_path)
    assert torch.equal(ad.parts["transformer_2"].proj_out.weight, saved)


def test_training_one_expert_keeps_the_other_frozen_and_shared(folders, tmp_path):
    ad = load_adapter(cfg_of(folders["a14b"], lora_rank=0, dtype="bfloat16"), keep_reference=True,
                      train_experts="low")
    high, low = ad.parts["transformer"], ad.parts["transformer_2"]
    assert ad.trained_parts == ("transformer_2",) and not any(p.requires_grad for p in high.parameters())
    assert high.dtype == torch.bfloat16 and low.dtype == torch.float32  # each expert takes its own dtype
    assert ad._reference.transformer is high and ad._reference.transformer_2 is not low  # no second frozen copy
    x, e = latents(ad, 2), ad.encode(["one a", "one b"], "", 1.0)
    v = ad.velocity(x, torch.full((2,), 0.9), e, 1.0)  # a high-noise step: only the frozen expert runs
    assert v.requires_grad
    grads = torch.autograd.grad(v.square().mean(), trainable(ad))
    assert all(torch.equal(g, torch.zeros_like(g)) for g in grads)
    ad.save_trainable(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["transformer_2"]
    with pytest.raises(ValueError, match="train_experts"):
        load_adapter(cfg_of(folders["ti2v"]), train_experts="low")  # one transformer: no low-noise expert
    high_only = load_adapter(cfg_of(folders["a14b"], lora_rank=0, train_experts="high"))  # model.train_experts
    assert high_only.trained_parts == ("transformer",)
    with pytest.raises(ConfigError, match="'model.train_experts'"):
        load_adapter(cfg_of(folders["a14b"], train_experts="middle"))


# ---------------------------------------------------------------------------------------------------------------
# TI2V-5B (expand_timesteps)
# ---------------------------------------------------------------------------------------------------------------


def test_ti2v_timesteps_per_token_latents_and_decode_match_the_stock_pipeline(lora):
    ad = lora("ti2v")
    assert not isinstance(ad.transformer, WanExperts) and ad.pipe.vae_scale_factor_spatial == 16
    call = {"prompt": "a red cube", "num_inference_steps": 3, "height": SIZE, "width": SIZE, "num_frames": FRAMES,
            "guidance_scale": G, "max_sequence_length": ad.max_sequence_length}
    with recording(ad.parts) as stock:
        final = ad.pipe(**call, generator=torch.Generator().manual_seed(7), output_type="latent").frames
    pixels = ad.pipe(**call, generator=torch.Generator().manual_seed(7), output_type="pt").frames

    noise = latents(ad, 1, seed=7)
    assert noise.shape == (1, *LATENTS["ti2v"]) and torch.equal(noise, stock[0][1])
    (_, x, t_pipe, v_c), (_, _, _, v_u) = stock[0], stock[1]
    assert t_pipe.shape == (1, 2 * 1 * 1)  # one timestep per patch token: 2 latent frames x (2/2) x (2/2)
    sigma = t_pipe[:, 0].float() / 1000
    with recording(ad.parts) as ours, torch.no_grad():
        v = ad.velocity(x.float(), sigma, ad.encode(["a red cube"], "", G), G)
    torch.testing.assert_close(ours[0][2], t_pipe.float(), rtol=1e-6, atol=1e-4)
    assert ours[0][2].shape == t_pipe.shape
    torch.testing.assert_close(v, v_u + G * (v_c - v_u), rtol=1e-4, atol=1e-4)

    videos = ad.decode(final)
    assert videos.shape == (1, FRAMES, 3, SIZE, SIZE)
    torch.testing.assert_close(videos, pixels, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------------------------------------------------
# Training through the policy
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("kind", "preset"), [("a14b", "tiny_flowgrpo"), ("a14b", "tiny_dancegrpo"),
                                              ("ti2v", "tiny_flowgrpo")])
def test_two_training_steps_are_exactly_on_policy_and_train_every_expert(kind, preset, folders, tmp_path,
                                                                         monkeypatch):
    """4 steps (two per expert for a14b), 4 samples in micro-batches of 2, CFG and KL. DanceGRPO trains a random
    subset of steps per sample, so its replays mix high- and low-noise rows in one forward."""
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr("mmgrpo.trainer.plot_metrics", lambda *args: None)
    reward = "rewards=[{name: video_frames, weight: 1.0, args: {image_reward: jpeg_compressibility, frames: 2}}]"
    cfg = load_config(ROOT / "configs" / "flow" / f"{preset}.yaml", [
        *RANDOM_TINY_SD3, "model.type=wan", f"model.path={folders[kind]}", "model.lora_rank=4",
        "model.lora_alpha=8", f"sampling.num_frames={FRAMES}", "sampling.num_steps=4", "sampling.eval_num_steps=2",
        f"sampling.guidance_scale={G}", "train.group_size=4", "train.micro_batch_size=2", "train.max_steps=2",
        "train.eval_every=0", "train.save_every=0", "logging.progress=false", "logging.plot_every=0",
        "optim.lr=1e-2", reward, f"output_dir={tmp_path}",
    ])
    policy = FlowPolicy(cfg)
    initial = {n: p.detach().clone() for n, p in policy.model.named_parameters() if p.requires_grad}
    grad_forwards = dict.fromkeys(["model", *policy.adapter.parts], 0)
    for name, module in [("model", policy.model), *policy.adapter.parts.items()]:
        module.register_forward_hook(
            lambda *_, name=name: grad_forwards.__setitem__(name, grad_forwards[name] + torch.is_grad_enabled()))
    rows = Trainer(cfg, policy=policy).train()
    assert rows[0]["ratio/onpolicy_max_dev"] <= 1e-6
    assert (rows[1]["kl"] > 0) == (cfg.grpo.kl_beta > 0)
    mixed = sum(grad_forwards.values()) - 2 * grad_forwards["model"]  # training forwards that ran both experts
    assert mixed > 0 if preset == "tiny_dancegrpo" else mixed <= 0
    for name in policy.adapter.trained_parts:
        moved = [not torch.equal(p, initial[n]) for n, p in policy.model.named_parameters()
                 if n in initial and (n.startswith(f"{name}.") or kind == "ti2v")]
        assert moved and any(moved), name


def test_two_processes_train_both_experts_in_sync(folders, train_on_two_processes):
    """DanceGRPO on the two-expert model under two gloo DDP processes: each process's replays mix experts
    differently (per-sample trained steps), and the idle expert's zero-times term keeps every LoRA weight in every
    graph, so DDP reduces the same parameters on both; low-noise steps guided by model.guidance_scale_2."""
    report = train_on_two_processes(
        ROOT / "configs" / "flow" / "tiny_dancegrpo.yaml", *RANDOM_TINY_SD3, "model.type=wan",
        f"model.path={folders['a14b']}", "model.lora_rank=4", "model.lora_alpha=8", "model.guidance_scale_2=2.0",
        f"sampling.num_frames={FRAMES}", "sampling.num_steps=4", f"sampling.guidance_scale={G}",
        "train.prompts_per_step=2", "train.group_size=4", "train.micro_batch_size=2", "train.max_steps=2",
        "optim.lr=1e-2", "rewards=[{name: video_frames, weight: 1.0, args: {image_reward: jpeg_compressibility, "
        "frames: 2}}]")
    assert report["num_processes"] == 2 and report["onpolicy_max_dev"] <= 1e-6
    assert report["param_rank_diff"] == 0.0 and report["param_change"] > 0
