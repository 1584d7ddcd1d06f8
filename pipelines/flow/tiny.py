"""Tiny random flow pipelines in the real diffusers on-disk format, built offline.

``build_tiny_pipeline(kind, directory)`` builds the real diffusers pipeline class from very small component configs
and ``save_pretrained``s it, so tests and the CPU demo load it through the same ``from_pretrained`` code that loads
the published checkpoints:

- ``sd3``: ``StableDiffusion3Pipeline`` shaped like SD3.5-Medium (MMDiT-X dual attention in the first block, RMS
  q/k norm), two CLIP text encoders with projection, a T5 encoder, a 16-channel 8x VAE, flow-matching Euler
  scheduler with shift 3.
- ``flux``: ``FluxPipeline`` shaped like FLUX.1-dev (guidance embedding, resolution-dependent shift).
- ``wan``: ``WanPipeline`` shaped like Wan2.1-T2V (UMT5 encoder, causal 3D VAE with 4x temporal and 8x spatial
  compression, UniPC flow scheduler with flow_shift 3).

Tokenizers are made without a network: the CLIP tokenizer is the real 49,408-token BPE converted from the vocabulary
file that open_clip ships, and the T5/UMT5 tokenizer is a 1,000-piece Unigram model trained in memory on a small
built-in corpus of short scene descriptions (``<pad>``=0, ``</s>``=1, ``<unk>``=2, as in T5).

``tiny_path(kind)`` builds each kind once per machine and library versions into
``$MMGRPO_CACHE/tiny/<kind>-v1-diffusers<version>-transformers<version>`` (default ``~/.cache/mmgrpo``), atomically,
and returns the folder: a pipeline saved by one release of diffusers or transformers may not load in another.
"""

from __future__ import annotations

import gzip
import itertools
import json
import os
import shutil
import string
import tempfile
from functools import lru_cache
from pathlib import Path

import torch

KINDS = ("sd3", "flux", "wan")
"""The pipeline kinds :func:`build_tiny_pipeline` knows."""

FORMAT_VERSION = 1
"""Bumped whenever a tiny pipeline changes, so cached folders of an older layout are not reused."""

CLIP_DIM = 16
"""Hidden width of the tiny CLIP text encoders (their 49,408-row token table dominates the size on disk)."""

T5_DIM = 64
"""d_model of the tiny T5/UMT5 encoders; also the transformers' text-embedding width."""

T5_VOCAB = 1000
"""Requested size of the in-memory Unigram vocabulary (the trainer may stop slightly below it)."""

T5_MAX_LENGTH = 32
"""``model_max_length`` of the tiny T5/UMT5 tokenizer. The adapters cap the pipelines' T5 sequence length (256 or
512 tokens, which would dominate a tiny model's cost) at it; the published tokenizers declare 512."""


def _bytes_to_unicode() -> dict[int, str]:
    """The byte -> printable character table of byte-level BPE (GPT-2 / CLIP).

    Printable Latin-1 bytes map to themselves; the remaining bytes take code points from 256 upwards, in order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


@lru_cache(maxsize=1)
def _clip_vocab_and_merges() -> tuple[dict[str, int], list[str]]:
    """CLIP's BPE vocabulary (49,408 tokens) and its 48,894 merges, read from open_clip's packaged file."""
    import open_clip

    path = Path(open_clip.__file__).parent / "bpe_simple_vocab_16e6.txt.gz"
    with gzip.open(path, "rt", encoding="utf-8") as f:
        lines = f.read().split("\n")
    merges = lines[1 : 49152 - 256 - 2 + 1]  # the first line is a header; CLIP keeps exactly this many merges
    symbols = list(_bytes_to_unicode().values())
    tokens = symbols + [s + "</w>" for s in symbols] + ["".join(m.split()) for m in merges]
    tokens += ["<|startoftext|>", "<|endoftext|>"]
    return {tok: i for i, tok in enumerate(tokens)}, merges


def clip_tokenizer():
    """A transformers ``CLIPTokenizer`` with the real CLIP vocabulary and ``model_max_length`` 77."""
    from transformers import CLIPTokenizer

    vocab, merges = _clip_vocab_and_merges()
    return CLIPTokenizer(vocab=dict(vocab), merges=[tuple(m.split()) for m in merges], model_max_length=77)


def _corpus() -> list[str]:
    """Training text for the Unigram tokenizer (deterministic): short scene descriptions with the words of typical
    text-to-image prompts, plus the 4,000 most frequent whole English words of the CLIP vocabulary."""
    counts = ["a", "one", "two", "three", "four", "many", "an"]
    colors = ["red", "green", "blue", "yellow", "purple", "orange", "black", "white", "pink", "brown", "gray"]
    things = ["cube", "sphere", "circle", "square", "triangle", "cat", "dog", "car", "tree", "house", "apple",
              "banana", "bird", "horse", "chair", "table", "cup", "book", "clock", "flower", "boat", "person"]
    places = ["on a table", "in a field", "on the beach", "in the city", "under the sky", "next to a wall",
              "in a forest", "at night", "in the snow", "on a black background"]
    styles = ["a photo of", "a painting of", "an image of", "a drawing of", "a close-up of", "a video of"]
    lines = [f"{s} {c} {col} {t} {p}" for s, c, col, t, p in
             itertools.islice(itertools.product(styles, counts, colors, things, places), 0, None, 7)]
    lines += [line.capitalize() + "." for line in lines[::5]]
    words = [t[:-4] for t in _clip_vocab_and_merges()[0] if t.endswith("</w>") and t[:-4].isascii()
             and t[:-4].isalpha() and len(t) > 5][:4000]  # CLIP's tokens are in merge (~frequency) order
    lines += [" ".join(words[i : i + 12]) for i in range(0, len(words), 12)]
    lines.append(" ".join(string.ascii_letters + string.digits + string.punctuation))
    return lines


@lru_cache(maxsize=1)
def _unigram_pieces() -> tuple[tuple[str, float], ...]:
    """(piece, log-probability) of a Unigram model trained on :func:`_corpus`; ``<pad>``, ``</s>``, ``<unk>`` first."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    specials = ["<pad>", "</s>", "<unk>"]
    unigram = Tokenizer(models.Unigram())
    unigram.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    trainer = trainers.UnigramTrainer(
        vocab_size=T5_VOCAB, special_tokens=specials, unk_token="<unk>", show_progress=False,
        initial_alphabet=list(string.ascii_letters + string.digits + string.punctuation),
    )
    unigram.train_from_iterator(_corpus(), trainer=trainer)
    pieces = tuple((piece, float(score)) for piece, score in json.loads(unigram.to_str())["model"]["vocab"])
    if [p for p, _ in pieces[:3]] != specials:
        raise RuntimeError(f"unexpected special-token order in the trained Unigram vocabulary: {pieces[:3]}")
    return pieces


def t5_tokenizer():
    """A transformers ``T5TokenizerFast`` over a Unigram vocabulary trained in memory on :func:`_corpus`."""
    from transformers import T5TokenizerFast

    return T5TokenizerFast(vocab=list(_unigram_pieces()), extra_ids=0, model_max_length=T5_MAX_LENGTH)


def _clip_config():
    from transformers import CLIPTextConfig

    return CLIPTextConfig(
        vocab_size=len(_clip_vocab_and_merges()[0]), hidden_size=CLIP_DIM, intermediate_size=2 * CLIP_DIM,
        num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=77, hidden_act="quick_gelu",
        projection_dim=CLIP_DIM, bos_token_id=49406, eos_token_id=49407, pad_token_id=49407,
    )


def _t5_kwargs(vocab_size: int) -> dict:
    return {
        "vocab_size": vocab_size, "d_model": T5_DIM, "d_kv": 16, "d_ff": 2 * T5_DIM, "num_layers": 2, "num_heads": 4,
        "relative_attention_num_buckets": 8, "relative_attention_max_distance": 32,
        "feed_forward_proj": "gated-gelu", "dropout_rate": 0.0, "pad_token_id": 0, "eos_token_id": 1,
        "decoder_start_token_id": 0,
    }


def _image_vae(scaling_factor: float, shift_factor: float):
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=16, layers_per_block=1, norm_num_groups=8,
        block_out_channels=(8, 16, 16, 16),  # three downsamplings: 8x
        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
        sample_size=64, scaling_factor=scaling_factor, shift_factor=shift_factor,
        use_quant_conv=False, use_post_quant_conv=False,
    )


def _build_sd3():
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline
    from transformers import CLIPTextModelWithProjection, T5Config, T5EncoderModel

    tokenizer_3 = t5_tokenizer()
    transformer = SD3Transformer2DModel(
        sample_size=32, patch_size=2, in_channels=16, out_channels=16, num_layers=2, attention_head_dim=32,
        num_attention_heads=4, joint_attention_dim=T5_DIM, caption_projection_dim=128,
        pooled_projection_dim=2 * CLIP_DIM, pos_embed_max_size=32, dual_attention_layers=(0,), qk_norm="rms_norm",
    )
    return StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0),
        vae=_image_vae(scaling_factor=1.5305, shift_factor=0.0609),
        text_encoder=CLIPTextModelWithProjection(_clip_config()),
        tokenizer=clip_tokenizer(),
        text_encoder_2=CLIPTextModelWithProjection(_clip_config()),
        tokenizer_2=clip_tokenizer(),
        text_encoder_3=T5EncoderModel(T5Config(**_t5_kwargs(len(tokenizer_3)))),
        tokenizer_3=tokenizer_3,
    )


def _build_flux():
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextModel, T5Config, T5EncoderModel

    tokenizer_2 = t5_tokenizer()
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=64, num_layers=1, num_single_layers=1, attention_head_dim=16,
        num_attention_heads=4, joint_attention_dim=T5_DIM, pooled_projection_dim=CLIP_DIM, guidance_embeds=True,
        axes_dims_rope=(4, 6, 6),
    )
    scheduler = FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
        base_image_seq_len=256, max_image_seq_len=4096,
    )
    return FluxPipeline(
        transformer=transformer, scheduler=scheduler,
        vae=_image_vae(scaling_factor=0.3611, shift_factor=0.1159),
        text_encoder=CLIPTextModel(_clip_config()), tokenizer=clip_tokenizer(),
        text_encoder_2=T5EncoderModel(T5Config(**_t5_kwargs(len(tokenizer_2)))), tokenizer_2=tokenizer_2,
    )


def _build_wan():
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    tokenizer = t5_tokenizer()
    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=16, out_channels=16,
        text_dim=T5_DIM, freq_dim=32, ffn_dim=64, num_layers=2, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", rope_max_seq_len=64,
    )
    vae = AutoencoderKLWan(base_dim=8, z_dim=16, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
                           temperal_downsample=[False, True, True])
    scheduler = UniPCMultistepScheduler(
        num_train_timesteps=1000, prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0,
    )
    return WanPipeline(
        transformer=transformer, vae=vae, scheduler=scheduler, tokenizer=tokenizer,
        text_encoder=UMT5EncoderModel(UMT5Config(**_t5_kwargs(len(tokenizer)))),
    )


_BUILDERS = {"sd3": _build_sd3, "flux": _build_flux, "wan": _build_wan}


def build_tiny_pipeline(kind: str, directory: Path, seed: int = 0) -> Path:
    """Build a tiny random pipeline of ``kind`` (sd3, flux or wan) and save it to ``directory`` (safetensors).

    The weights depend only on ``seed``; the global torch RNG is left untouched. Returns ``directory``."""
    if kind not in _BUILDERS:
        raise ValueError(f"unknown tiny pipeline kind '{kind}' (known: {', '.join(KINDS)})")
    directory = Path(directory)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        pipe = _BUILDERS[kind]()
    pipe.save_pretrained(directory, safe_serialization=True)
    return directory


def cache_root() -> Path:
    """Where tiny pipelines are cached: ``$MMGRPO_CACHE/tiny`` (default ``~/.cache/mmgrpo/tiny``)."""
    return Path(os.environ.get("MMGRPO_CACHE", "~/.cache/mmgrpo")).expanduser() / "tiny"


def cache_folder(kind: str) -> Path:
    """The cache folder of the tiny ``kind`` pipeline under the installed diffusers and transformers."""
    import diffusers
    import transformers

    return cache_root() / f"{kind}-v{FORMAT_VERSION}-diffusers{diffusers.__version__}-transformers{transformers.__version__}"


def tiny_path(kind: str) -> Path:
    """The folder of the cached tiny ``kind`` pipeline, built on first use under the installed diffusers and
    transformers (their versions name the folder, so another release builds its own).

    The build goes to a temporary folder next to the destination, which is then renamed into place, so a reader
    never sees a half-written pipeline; when two processes race, the loser discards its copy."""
    if kind not in _BUILDERS:
        raise ValueError(f"unknown tiny pipeline kind '{kind}' (known: {', '.join(KINDS)})")
    final = cache_folder(kind)
    if (final / "model_index.json").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{kind}-building-", dir=final.parent))
    try:
        build_tiny_pipeline(kind, staging)
        try:
            os.rename(staging, final)
        except OSError:
            if not (final / "model_index.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return final
