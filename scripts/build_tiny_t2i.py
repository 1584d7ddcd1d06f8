"""Build ``assets/tiny-sd3-shapes``: a tiny ShapesT2I text-to-image model in the diffusers SD3 pipeline format.

Stages (seeded, one thread, so a rerun with the same arguments on the same machine repeats them):

1. tokenizers: a ``CLIPTokenizer`` whose BPE merges spell every task word as one token (112 tokens, length 10) and
   a Unigram ``T5Tokenizer`` with one piece per word (``model_max_length`` 10);
2. data: ``--num-images`` 64x64 renders of training prompts (half count prompts, half relation prompts);
3. VAE: an ``AutoencoderKL`` with 4x downsampling and 4 latent channels, trained on 32x32 crops of the renders
   (L1 + MSE with objects weighted 5x, tiny KL); its ``shift_factor`` / ``scaling_factor`` standardise the latents;
4. flow model: an ``SD3Transformer2DModel`` (16x16x4 latents, patch 2, 4 layers, width 128), two tiny
   ``CLIPTextModelWithProjection`` and a tiny ``T5EncoderModel``, trained jointly by rectified-flow matching
   (x_t = (1-t) x0 + t noise, target noise - x0, t logit-normal, timestep = 1000 t as in diffusers), the prompt
   dropped to "" 10% of the time for CFG, with an EMA of the weights. Two options teach the relation's direction
   (which object goes left): ``--high-noise-frac`` draws that share of each batch at t in [0.7, 1], where the layout
   is decided and logit-normal t rarely lands, and ``--layout-weight`` adds a linear head on the pooled CLIP
   embedding that must name the left (or top) object and the right (or bottom) one whatever the word order
   (discarded at export). Every ``--eval-every`` steps the EMA weights are scored on held-out prompts and saved as
   ``ema-step-N.pt``;
5. export: the EMA weights as an fp16 ``StableDiffusion3Pipeline`` folder, reloaded with ``from_pretrained`` in
   fp32 and evaluated through the real pipeline over a grid of steps and CFG.

The T5 part of the prompt embedding is ``max_sequence_length`` tokens; the model is trained with 10 (the T5
tokenizer's ``model_max_length``), so callers pass ``max_sequence_length=10``.

The shipped asset was built in three runs: the second continues the first with a linear lr decay and exports the
folder; the third continues from that folder (with its VAE) with both direction options, a smaller EMA decay and
fresh renders, and replaces it:

    nice -n 10 python scripts/build_tiny_t2i.py --steps 1800
    nice -n 10 python scripts/build_tiny_t2i.py --work runs/build-tiny-t2i-2 --reuse runs/build-tiny-t2i/data.pt \
        --init runs/build-tiny-t2i/ema-step-1800.pt --steps 3600 --decay 0.3
    nice -n 10 python scripts/build_tiny_t2i.py --work runs/build-tiny-t2i-3 --init assets/tiny-sd3-shapes \
        --vae-from assets/tiny-sd3-shapes --num-images 20000 --steps 1500 --lr 3e-4 --decay 0.3 --ema 0.995 \
        --high-noise-frac 0.5 --layout-weight 1.0 --eval-every 150

Either direction option alone left the direction at chance within 900-1200 steps of the third run (the layout head
fits within 900 steps, but the transformer does not use it until the high-noise steps are trained); together they
take it from 0.39 to 0.96 of the relation samples in 1200 steps.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import os
import shutil
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from diffusers import (
    AutoencoderKL,
    FlowMatchEulerDiscreteScheduler,
    SD3Transformer2DModel,
    StableDiffusion3Pipeline,
)
from transformers import (
    CLIPTextConfig,
    CLIPTextModelWithProjection,
    CLIPTokenizer,
    T5Config,
    T5EncoderModel,
    T5Tokenizer,
)

from mmgrpo.registry import REWARDS, TASKS
from mmgrpo.rewards import RewardBatch
from mmgrpo.tasks.shapes import COLOURS, RELATIONS, SHAPES, parse_prompt

TASK = TASKS.get("shapes_t2i")
WORDS = "a two three red green blue yellow circle circles square squares triangle triangles left right of above below"
MAX_LEN = 10
LATENT = (4, 16, 16)
JOINT_DIM = 128
SHIFT = 1.0
ROOT = Path(__file__).resolve().parents[1]


def log(message: str, path: Path | None = None) -> None:
    line = f"[{time.strftime('%H:%M:%S')}] {message}"
    print(line, flush=True)
    if path is not None:
        with path.open("a") as f:
            f.write(line + "\n")


def build_tokenizer(folder: Path) -> CLIPTokenizer:
    """Write vocab.json + merges.txt such that BPE turns every task word into one token; load them."""

    def bpe(word: str, ranks: dict) -> list[str]:
        parts = list(word[:-1]) + [word[-1] + "</w>"]
        while len(parts) > 1:
            rank, i = min((ranks.get(pair, float("inf")), i) for i, pair in enumerate(itertools.pairwise(parts)))
            if rank == float("inf"):
                break
            parts[i:i + 2] = [parts[i] + parts[i + 1]]
        return parts

    ranks: dict[tuple[str, str], int] = {}
    for word in WORDS.split():  # each new merge ranks last, so it never changes how earlier words split
        while len(parts := bpe(word, ranks)) > 1:
            ranks[(parts[0], parts[1])] = len(ranks)
    letters = "abcdefghijklmnopqrstuvwxyz"
    vocab = ["<|startoftext|>", "<|endoftext|>", *letters, *(c + "</w>" for c in letters)]
    vocab += list(dict.fromkeys(a + b for a, b in ranks if a + b not in vocab))
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.json").write_text(json.dumps({t: i for i, t in enumerate(vocab)}))
    (folder / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in ranks))
    tokenizer = CLIPTokenizer(vocab=str(folder / "vocab.json"), merges=str(folder / "merges.txt"),
                              model_max_length=MAX_LEN)
    for word in WORDS.split():
        assert len(tokenizer(word, add_special_tokens=False).input_ids) == 1, word
    return tokenizer


def build_t5_tokenizer() -> T5Tokenizer:
    """A Unigram T5 tokenizer with one piece per task word (plus letters, so other text still tokenizes)."""
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    pieces += [("\u2581" + w, -1.0) for w in WORDS.split()] + [(c, -10.0) for c in "abcdefghijklmnopqrstuvwxyz"]
    tokenizer = T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=MAX_LEN)
    for word in WORDS.split():
        assert len(tokenizer(word, add_special_tokens=False).input_ids) == 1, word
    return tokenizer


def t5_encoder(vocab_size: int) -> T5EncoderModel:
    return T5EncoderModel(T5Config(
        vocab_size=vocab_size, d_model=JOINT_DIM, d_kv=32, d_ff=256, num_layers=1, num_heads=4,
        relative_attention_num_buckets=8, relative_attention_max_distance=16, dropout_rate=0.0,
        feed_forward_proj="gated-gelu"))


def text_encoder(vocab_size: int) -> CLIPTextModelWithProjection:
    return CLIPTextModelWithProjection(CLIPTextConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=2,
        max_position_embeddings=MAX_LEN, projection_dim=32, bos_token_id=0, eos_token_id=1, pad_token_id=1))


def new_transformer() -> SD3Transformer2DModel:
    return SD3Transformer2DModel(
        sample_size=LATENT[1], patch_size=2, in_channels=LATENT[0], out_channels=LATENT[0], num_layers=4,
        attention_head_dim=32, num_attention_heads=4, joint_attention_dim=JOINT_DIM, caption_projection_dim=128,
        pooled_projection_dim=64, pos_embed_max_size=LATENT[1] // 2, qk_norm="rms_norm")


def new_vae() -> AutoencoderKL:
    return AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 3,
        up_block_types=("UpDecoderBlock2D",) * 3, block_out_channels=(8, 16, 32), layers_per_block=1,
        latent_channels=LATENT[0], norm_num_groups=8, sample_size=64, mid_block_add_attention=False)


def sample_specs(n: int, rng: np.random.Generator, items: list[dict]) -> list[dict]:
    """n prompt specs: a count prompt or a relation prompt with probability 1/2 each, then uniform."""
    by_kind = [[it for it in items if it["kind"] == kind] for kind in ("count", "relation")]
    return [by_kind[k][rng.integers(len(by_kind[k]))] for k in rng.integers(0, 2, size=n)]


def render_dataset(n: int, seed: int) -> tuple[torch.Tensor, list[str]]:
    """(n, 3, 64, 64) uint8 renders of training prompts and their prompts."""
    specs = sample_specs(n, np.random.default_rng(seed), TASK.items("train"))
    images = np.stack([TASK.render(spec, seed * 7_919 + i) for i, spec in enumerate(specs)])
    return torch.from_numpy((images * 255).round().astype(np.uint8)), [s["prompt"] for s in specs]


LAYOUT_CLASSES = (len(COLOURS), len(SHAPES), len(COLOURS) + 1, len(SHAPES) + 1, 3)
"""Classes of the layout head's five outputs: colour and shape of the first object, colour and shape of the second
(plus "none" for count prompts) and the axis (horizontal, vertical, none)."""


def layout_labels(prompts: list[str]) -> torch.Tensor:
    """(n, 5) canonical layout of each prompt: the left (or top) object first, whatever the word order; "" -> -100
    (ignored). "a red circle right of a blue square" and "a blue square left of a red circle" get the same labels."""
    rows = []
    for prompt in prompts:
        if not prompt:
            rows.append([-100] * 5)
            continue
        spec = parse_prompt(prompt)
        objs = [(list(COLOURS).index(o["colour"]), SHAPES.index(o["shape"])) for o in spec["objects"]]
        if spec["relation"] is None:
            rows.append([*objs[0], len(COLOURS), len(SHAPES), 2])
            continue
        axis, sign = RELATIONS[spec["relation"]]
        first, second = objs if sign < 0 else objs[::-1]
        rows.append([*first, *second, axis])
    return torch.tensor(rows)


def layout_loss(head: torch.nn.Linear, pooled: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the layout head on the pooled prompt embedding (B, 64), summed over the five outputs."""
    logits = head(pooled).split(LAYOUT_CLASSES, dim=-1)
    return sum(F.cross_entropy(lg, labels[:, i], ignore_index=-100) for i, lg in enumerate(logits))


def to_model(images: torch.Tensor) -> torch.Tensor:
    return images.float() / 127.5 - 1


def train_vae(images: torch.Tensor, args: argparse.Namespace, logfile: Path) -> AutoencoderKL:
    torch.manual_seed(args.seed)
    vae = new_vae().to(memory_format=torch.channels_last)  # 2x faster small-channel convolutions on CPU
    opt = torch.optim.AdamW(vae.parameters(), lr=2e-3, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=2e-3, total_steps=args.vae_steps, pct_start=0.05)
    gen = torch.Generator().manual_seed(args.seed)
    start = time.time()
    for step in range(1, args.vae_steps + 1):
        top, left = torch.randint(64 - args.vae_crop + 1, (2,), generator=gen).tolist()
        crops = images[torch.randint(len(images), (args.vae_batch,), generator=gen), :, top:top + args.vae_crop,
                       left:left + args.vae_crop]  # the VAE is convolutional: crops train it 4x cheaper
        x = to_model(crops).contiguous(memory_format=torch.channels_last)
        posterior = vae.encode(x).latent_dist
        rec = vae.decode(posterior.sample(generator=gen)).sample
        weight = 1 + 4 * (x > 0).any(1, keepdim=True)  # objects cover ~12% of the pixels: weigh them 5x
        loss = (weight * ((rec - x).abs() + (rec - x).square())).mean() + 1e-6 * posterior.kl().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        if step % 25 == 0 or step == args.vae_steps:
            log(f"vae step {step}/{args.vae_steps} loss {loss.item():.4f} ({time.time() - start:.0f} s)", logfile)
        if time.time() - start > args.vae_minutes * 60:
            log(f"vae: time budget reached at step {step}", logfile)
            break
    return vae.to(memory_format=torch.contiguous_format).eval()


@torch.no_grad()
def encode_latents(vae: AutoencoderKL, images: torch.Tensor) -> torch.Tensor:
    return torch.cat([vae.encode(to_model(images[i:i + 256])).latent_dist.mean for i in range(0, len(images), 256)])


@torch.no_grad()
def decode(vae: AutoencoderKL, latents: torch.Tensor) -> torch.Tensor:
    """Normalised latents -> (B, 3, H, W) images in [0, 1], as the SD3 pipeline decodes them."""
    raw = latents / vae.config.scaling_factor + vae.config.shift_factor
    return (vae.decode(raw).sample / 2 + 0.5).clamp(0, 1)


def evaluate(images: torch.Tensor, specs: list[dict]) -> dict[str, float]:
    batch = RewardBatch(prompts=[s["prompt"] for s in specs], group=torch.arange(len(specs)), images=images,
                        meta=specs)
    return {k: v.mean().item() for k, v in REWARDS.build("shapes_eval")(batch).items()}


def tokenize(tokenizers: tuple, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """CLIP and T5 token ids of prompts, padded to MAX_LEN as the pipeline pads them."""
    return tuple(tok(prompts, padding="max_length", max_length=MAX_LEN, truncation=True, return_tensors="pt").input_ids
                 for tok in tokenizers)


def prompt_embeds(models: dict, clip_ids: torch.Tensor, t5_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The SD3 pipeline's prompt encoding: penultimate states of both CLIP encoders side by side, then the T5
    states along the sequence; pooled = both CLIP projections."""
    out1 = models["text_encoder"](clip_ids, output_hidden_states=True)
    out2 = models["text_encoder_2"](clip_ids, output_hidden_states=True)
    clip = torch.cat([out1.hidden_states[-2], out2.hidden_states[-2]], -1)
    embeds = torch.cat([clip, models["text_encoder_3"](t5_ids)[0]], 1)
    return embeds, torch.cat([out1.text_embeds, out2.text_embeds], -1)


@torch.no_grad()
def sample(models: dict, tokenizers: tuple, prompts: list[str], steps: int, cfg: float, seed: int) -> torch.Tensor:
    """Euler ODE sampling with CFG, the same math as StableDiffusion3Pipeline.__call__ (for quick evals)."""
    ids = [torch.cat(pair) for pair in zip(tokenize(tokenizers, [""] * len(prompts)), tokenize(tokenizers, prompts))]
    emb, pooled = prompt_embeds(models, *ids)
    scheduler = FlowMatchEulerDiscreteScheduler(shift=SHIFT)
    scheduler.set_timesteps(steps)
    x = torch.randn(len(prompts), *LATENT, generator=torch.Generator().manual_seed(seed))
    for t in scheduler.timesteps:
        v = models["transformer"](torch.cat([x, x]), encoder_hidden_states=emb, pooled_projections=pooled,
                                  timestep=t.expand(2 * len(x))).sample
        v_uncond, v_cond = v.chunk(2)
        x = scheduler.step(v_uncond + cfg * (v_cond - v_uncond), t, x).prev_sample
    return decode(models["vae"], x)


def quick_eval(models: dict, tokenizers: tuple, n: int, seed: int) -> dict[str, float]:
    result = {}
    for split in ("heldout", "train"):
        items = TASK.items(split)
        specs = [items[i % len(items)] for i in range(n)]
        images = torch.cat([sample(models, tokenizers, [s["prompt"] for s in specs[i:i + 64]], 10, 4.5, seed + i)
                            for i in range(0, n, 64)])
        result[split] = evaluate(images, specs)
    return result


def load_state(path: Path) -> dict[str, dict]:
    """Flow-model state dicts (fp32) from an ``ema-step-N.pt`` checkpoint or from an exported pipeline folder."""
    if not path.is_dir():
        return torch.load(path)
    pipe = StableDiffusion3Pipeline.from_pretrained(path, dtype=torch.float32)
    return {k: getattr(pipe, k).state_dict() for k in ("transformer", "text_encoder", "text_encoder_2", "text_encoder_3")}


def train_flow(latents: torch.Tensor, prompts: list[str], vae: AutoencoderKL, tokenizers: tuple, args, work: Path):
    """Joint flow-matching training of the transformer and the three text encoders; returns the EMA models."""
    logfile = work / "log.txt"
    torch.manual_seed(args.seed)
    models = {"transformer": new_transformer(), "text_encoder": text_encoder(len(tokenizers[0])),
              "text_encoder_2": text_encoder(len(tokenizers[0])), "text_encoder_3": t5_encoder(len(tokenizers[1]))}
    if args.init is not None:
        for key, state in load_state(args.init).items():
            models[key].load_state_dict(state)
        log(f"flow: initialised from {args.init}", logfile)
    ema = {k: copy.deepcopy(m).eval().requires_grad_(False) for k, m in models.items()}
    params = [p for m in models.values() for p in m.parameters()]
    head = None
    if args.layout_weight > 0:
        head = torch.nn.Linear(models["transformer"].config.pooled_projection_dim, sum(LAYOUT_CLASSES))
        params += list(head.parameters())
    log(f"flow: transformer {sum(p.numel() for p in models['transformer'].parameters()) / 1e6:.2f}M params, "
        f"text encoders {sum(p.numel() for k in models if k != 'transformer' for p in models[k].parameters()) / 1e6:.2f}M",
        logfile)
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.99), weight_decay=0.01)
    ids, empty, labels = tokenize(tokenizers, prompts), tokenize(tokenizers, [""]), layout_labels(prompts)
    gen = torch.Generator().manual_seed(args.seed + 1)
    start, step = time.time(), 0
    while step < args.steps and time.time() - start < args.minutes * 60:
        step += 1
        lr = args.lr * min(1.0, step / 200, (args.steps - step + 1) / max(1.0, args.decay * args.steps))
        for group in opt.param_groups:
            group["lr"] = lr
        idx = torch.randint(len(latents), (args.batch,), generator=gen)
        x0 = latents[idx]
        drop = torch.rand(args.batch, 1, generator=gen) < 0.1
        batch_ids = [torch.where(drop, e, i[idx]) for e, i in zip(empty, ids)]
        sigma = torch.sigmoid(torch.randn(args.batch, generator=gen))
        if args.high_noise_frac > 0:  # (draws nothing otherwise, so earlier runs repeat)
            high = torch.rand(args.batch, generator=gen) < args.high_noise_frac
            sigma = torch.where(high, 1 - 0.3 * torch.rand(args.batch, generator=gen), sigma)
        noise = torch.randn(x0.shape, generator=gen)
        s = sigma.view(-1, 1, 1, 1)
        emb, pooled = prompt_embeds(models, *batch_ids)
        pred = models["transformer"](hidden_states=(1 - s) * x0 + s * noise, encoder_hidden_states=emb,
                                     pooled_projections=pooled, timestep=sigma * 1000).sample
        flow_loss = F.mse_loss(pred, noise - x0)
        aux_loss = torch.zeros(()) if head is None else layout_loss(head, pooled, torch.where(drop, -100, labels[idx]))
        loss = flow_loss + args.layout_weight * aux_loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        decay = min(args.ema, (1 + step) / (10 + step))
        with torch.no_grad():
            for key, model in models.items():
                for p_ema, p in zip(ema[key].parameters(), model.parameters()):
                    p_ema.lerp_(p, 1 - decay)
        if step % 50 == 0:
            log(f"flow step {step} loss {flow_loss.item():.4f} layout loss {aux_loss.item():.3f} lr {lr:.2e} ({time.time() - start:.0f} s)", logfile)
        if step % args.eval_every == 0:
            scores = quick_eval({**ema, "vae": vae}, tokenizers, args.eval_samples, seed=12_345)
            log(f"eval step {step}: heldout score {scores['heldout']['score']:.3f} train score "
                f"{scores['train']['score']:.3f} heldout subs "
                f"{ {k: round(v, 3) for k, v in scores['heldout'].items()} }", logfile)
            torch.save({k: m.state_dict() for k, m in ema.items()}, work / f"ema-step-{step}.pt")
    log(f"flow: stopped at step {step} after {(time.time() - start) / 60:.1f} min", logfile)
    return ema


def export(ema: dict, vae: AutoencoderKL, tokenizers: tuple, tokenizer_dir: Path, out: Path) -> None:
    """Save the fp16 pipeline folder; the CLIP tokenizer folders also keep vocab.json + merges.txt."""
    parts = {k: copy.deepcopy(m).half() for k, m in {**ema, "vae": vae}.items()}
    pipe = StableDiffusion3Pipeline(scheduler=FlowMatchEulerDiscreteScheduler(shift=SHIFT), tokenizer=tokenizers[0],
                                    tokenizer_2=tokenizers[0], tokenizer_3=tokenizers[1], **parts)
    if out.exists():
        shutil.rmtree(out)
    pipe.save_pretrained(out, safe_serialization=True)
    for sub in ("tokenizer", "tokenizer_2"):
        for name in ("vocab.json", "merges.txt"):
            shutil.copy(tokenizer_dir / name, out / sub / name)


def pipeline_eval(out: Path, grid: list[tuple[int, float]], n: int, logfile: Path) -> None:
    """Accuracy of the saved folder through the real StableDiffusion3Pipeline, per split and kind."""
    pipe = StableDiffusion3Pipeline.from_pretrained(out, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    for steps, cfg in grid:
        for split in ("heldout", "train"):
            items = TASK.items(split)
            specs = [items[i % len(items)] for i in range(n)]
            start = time.time()
            images = torch.cat([
                pipe([s["prompt"] for s in specs[i:i + 32]], num_inference_steps=steps, guidance_scale=cfg,
                     max_sequence_length=MAX_LEN, output_type="pt",
                     generator=torch.Generator().manual_seed(1000 + i)).images
                for i in range(0, n, 32)])
            per_image = (time.time() - start) / n
            scores = evaluate(images, specs)
            kinds = {kind: evaluate(images[[j for j, s in enumerate(specs) if s["kind"] == kind]],
                                    [s for s in specs if s["kind"] == kind])["score"] for kind in ("count", "relation")}
            log(f"pipeline steps={steps} cfg={cfg} {split}: score {scores['score']:.3f} "
                f"(count {kinds['count']:.3f}, relation {kinds['relation']:.3f}) "
                f"subs { {k: round(v, 3) for k, v in scores.items()} } {per_image * 1000:.0f} ms/image", logfile)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "assets" / "tiny-sd3-shapes")
    parser.add_argument("--work", type=Path, default=ROOT / "runs" / "build-tiny-t2i")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-images", type=int, default=40_000)
    parser.add_argument("--vae-steps", type=int, default=3000)
    parser.add_argument("--vae-batch", type=int, default=32)
    parser.add_argument("--vae-crop", type=int, default=32)
    parser.add_argument("--vae-minutes", type=float, default=20.0, help="wall-time cap of VAE training")
    parser.add_argument("--steps", type=int, default=1800, help="flow-matching optimiser steps")
    parser.add_argument("--minutes", type=float, default=120.0, help="wall-time cap of flow-matching training")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--decay", type=float, default=0.0, help="fraction of --steps at the end with linear lr decay")
    parser.add_argument("--ema", type=float, default=0.999)
    parser.add_argument("--eval-every", type=int, default=600)
    parser.add_argument("--eval-samples", type=int, default=128)
    parser.add_argument("--final-samples", type=int, default=256, help="images per split in the final evaluation")
    parser.add_argument("--reuse", type=Path, help="data.pt of an earlier run: reuse its latents, prompts and VAE")
    parser.add_argument("--vae-from", type=Path, help="pipeline folder whose VAE to use instead of training one")
    parser.add_argument("--init", type=Path,
                        help="continue flow training from an ema-step-N.pt checkpoint or an exported pipeline folder")
    parser.add_argument("--high-noise-frac", type=float, default=0.0,
                        help="fraction of each batch with sigma uniform in [0.7, 1], where the layout is decided")
    parser.add_argument("--layout-weight", type=float, default=0.0,
                        help="weight of the layout head's loss on the pooled prompt embedding (0: off)")
    parser.add_argument("--threads", type=int, default=1, help="1 is fastest on a busy CPU (no OpenMP spinning)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    args.work.mkdir(parents=True, exist_ok=True)
    logfile = args.work / "log.txt"
    log(f"args: {vars(args)}", logfile)
    tokenizers = (build_tokenizer(args.work / "tokenizer"), build_t5_tokenizer())
    if args.reuse is not None:
        data = torch.load(args.reuse)
        vae = new_vae()
        vae.load_state_dict(data["vae"])
        vae.register_to_config(**data["vae_config"])
        vae.eval()
        log(f"reused data, VAE and latents from {args.reuse}", logfile)
    else:
        images, prompts = render_dataset(args.num_images, args.seed)
        log(f"rendered {len(images)} images", logfile)
        if args.vae_from is not None:
            vae = AutoencoderKL.from_pretrained(args.vae_from, subfolder="vae", dtype=torch.float32).eval()
            log(f"vae: loaded from {args.vae_from}", logfile)
        else:
            vae = train_vae(images, args, logfile)
        raw = encode_latents(vae, images)
        if args.vae_from is None:
            vae.register_to_config(shift_factor=raw.mean().item(), scaling_factor=1 / raw.std().item())
        vae_config = {k: vae.config[k] for k in ("shift_factor", "scaling_factor")}
        test = TASK.items("heldout")[:128]
        originals = torch.from_numpy(np.stack([TASK.render(s, 10**6 + i) for i, s in enumerate(test)]))
        with torch.no_grad():
            recon = (vae.decode(vae.encode(originals * 2 - 1).latent_dist.mean).sample / 2 + 0.5).clamp(0, 1)
        log(f"vae: latent shift {vae_config['shift_factor']:.3f} scale {vae_config['scaling_factor']:.3f}; "
            f"evaluator on held-out renders {evaluate(originals, test)['score']:.3f}, on their reconstructions "
            f"{evaluate(recon, test)['score']:.3f}", logfile)
        data = {"latents": (raw - vae_config["shift_factor"]) * vae_config["scaling_factor"], "prompts": prompts,
                "vae": vae.state_dict(), "vae_config": vae_config}
        torch.save(data, args.work / "data.pt")
    ema = train_flow(data["latents"], data["prompts"], vae, tokenizers, args, args.work)
    export(ema, vae, tokenizers, args.work / "tokenizer", args.out)
    size = sum(f.stat().st_size for f in args.out.rglob("*") if f.is_file())
    log(f"exported {args.out} ({size / 1e6:.2f} MB)", logfile)
    pipeline_eval(args.out, [(10, 4.5), (20, 4.5), (10, 1.0), (10, 3.0), (10, 7.0)], args.final_samples, logfile)


if __name__ == "__main__":
    main()
