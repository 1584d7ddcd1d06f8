"""Tiny random Qwen2-VL / Qwen2.5-VL / Qwen3-VL checkpoints in the real on-disk format, built offline.

``build_tiny_vlm`` writes a folder that ``AutoModelForImageTextToText.from_pretrained`` and
``AutoProcessor.from_pretrained`` load like a hub checkpoint: config + safetensors weights, a byte-level
``Qwen2Tokenizer`` (256 byte symbols, the Qwen special tokens and chat template; by default no merges), and the real
Qwen2-VL image and video processors (Qwen3-VL: its own video processor, which writes frame times into the
prompt). ``tiny_path`` builds it once into a cache folder.

Given a ``corpus``, the tokenizer also gets byte-pair merges learned on it (every word of the corpus becomes one
token, any other text still encodes byte by byte) and ``tags`` (e.g. ``<think>``) become single added tokens that
decoding keeps: a task-sized vocabulary, so a tiny model reads and writes whole words.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from collections import Counter
from collections.abc import Iterable, Sequence
from itertools import pairwise
from pathlib import Path

import torch

KINDS = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
VERSION = "v1"

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                  "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"]

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def byte_symbols() -> list[str]:
    """The 256 printable symbols that byte-level BPE uses for the bytes 0..255 (GPT-2 mapping), in byte order."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    symbols, extra = {}, 0
    for b in range(256):
        if b in printable:
            symbols[b] = chr(b)
        else:
            symbols[b] = chr(256 + extra)
            extra += 1
    return [symbols[b] for b in range(256)]


def merge_pair(symbols: tuple[str, ...], pair: tuple[str, str]) -> tuple[str, ...]:
    """``symbols`` with every left-to-right occurrence of ``pair`` joined into one symbol."""
    out, i = [], 0
    while i < len(symbols):
        if symbols[i:i + 2] == pair:
            out.append(pair[0] + pair[1])
            i += 2
        else:
            out.append(symbols[i])
            i += 1
    return tuple(out)


def learn_merges(words: Counter[str]) -> list[tuple[str, str]]:
    """Byte-pair merges of ``words`` (byte-symbol strings -> counts): the most frequent pair first (ties by the
    larger pair), until every word is one symbol."""
    pieces = {word: tuple(word) for word in words}
    merges = []
    while True:
        pairs: Counter[tuple[str, str]] = Counter()
        for word, symbols in pieces.items():
            for pair in pairwise(symbols):
                pairs[pair] += words[word]
        if not pairs:
            return merges
        best = max(pairs, key=lambda pair: (pairs[pair], pair))
        merges.append(best)
        pieces = {word: merge_pair(symbols, best) for word, symbols in pieces.items()}


def build_tokenizer(corpus: Iterable[str] = (), tags: Sequence[str] = ()):
    """Byte-level ``Qwen2Tokenizer``: ids 0..255 are the bytes, then one id per merge learned on ``corpus`` (none by
    default), then the Qwen special tokens in Qwen order, then ``tags`` as non-special added tokens."""
    from tokenizers import AddedToken
    from transformers import Qwen2Tokenizer

    merges: list[tuple[str, str]] = []
    corpus = list(corpus)
    if corpus:
        splitter = build_tokenizer().backend_tokenizer.pre_tokenizer
        added = re.compile("|".join(re.escape(t) for t in [*SPECIAL_TOKENS, *tags]))
        words = Counter(piece for text in corpus for part in added.split(text)
                        for piece, _ in splitter.pre_tokenize_str(part))
        merges = learn_merges(words)
    symbols = dict.fromkeys(byte_symbols() + [a + b for a, b in merges])  # two merges may spell one symbol
    vocab = {symbol: i for i, symbol in enumerate([*symbols, *SPECIAL_TOKENS])}
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=merges, unk_token=None, eos_token="<|im_end|>",
                               pad_token="<|endoftext|>")
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS})
    if tags:
        tokenizer.add_tokens([AddedToken(tag, special=False, normalized=False) for tag in tags])
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def tiny_config(kind: str, token_ids: dict[str, int], vocab_size: int, hidden_size: int, num_layers: int,
                vision_depth: int = 2, vision_width: int = 32, patch_size: int = 14):
    """Config of a language model with 4 query / 2 key-value heads and a ``vision_depth``-layer,
    ``vision_width``-wide vision tower (2 heads) on ``patch_size``-pixel patches whose merger outputs
    ``hidden_size``. M-RoPE splits head_dim/2 into temporal, height and width sections like the real models:
    contiguous 1:1.5:1.5 (16:24:24) for Qwen2-VL and Qwen2.5-VL, interleaved 2:1:1 (24:20:20) for Qwen3-VL, whose
    tower also feeds its first layer's features to the language model (DeepStack)."""
    from transformers import Qwen2_5_VLConfig, Qwen2VLConfig, Qwen3VLConfig

    half = hidden_size // 8  # head_dim / 2 with 4 heads
    if kind == "qwen3_vl":
        height = half // 4
        sections = [half - 2 * height, height, height]
    else:
        temporal = half // 4
        height = (half - temporal) // 2
        sections = [temporal, height, half - temporal - height]
    text = {"vocab_size": vocab_size, "hidden_size": hidden_size, "intermediate_size": 2 * hidden_size,
            "num_hidden_layers": num_layers, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 32768,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": sections},
            "bos_token_id": token_ids["<|endoftext|>"], "eos_token_id": token_ids["<|im_end|>"],
            "pad_token_id": token_ids["<|endoftext|>"]}
    ids = {"image_token_id": token_ids["<|image_pad|>"], "video_token_id": token_ids["<|video_pad|>"],
           "vision_start_token_id": token_ids["<|vision_start|>"], "vision_end_token_id": token_ids["<|vision_end|>"]}
    if kind == "qwen2_vl":
        vision = {"depth": vision_depth, "embed_dim": vision_width, "hidden_size": hidden_size, "num_heads": 2,
                  "mlp_ratio": 2, "patch_size": patch_size, "spatial_merge_size": 2, "temporal_patch_size": 2}
        return Qwen2VLConfig(text_config=text, vision_config=vision, **ids)
    if kind == "qwen3_vl":
        text.update(head_dim=hidden_size // 4, rope_parameters={**text["rope_parameters"], "mrope_interleaved": True})
        vision = {"depth": vision_depth, "hidden_size": vision_width, "intermediate_size": 2 * vision_width,
                  "num_heads": 2, "out_hidden_size": hidden_size, "patch_size": patch_size, "spatial_merge_size": 2,
                  "temporal_patch_size": 2, "num_position_embeddings": 64, "deepstack_visual_indexes": [0]}
        return Qwen3VLConfig(text_config=text, vision_config=vision, **ids)
    vision = {"depth": vision_depth, "hidden_size": vision_width, "intermediate_size": 2 * vision_width, "num_heads": 2,
              "out_hidden_size": hidden_size, "patch_size": patch_size, "spatial_merge_size": 2, "temporal_patch_size": 2,
              "window_size": 56, "fullatt_block_indexes": [vision_depth - 1], "tokens_per_second": 2}
    return Qwen2_5_VLConfig(text_config=text, vision_config=vision, **ids)


def build_tiny_vlm(kind: str, directory: str | os.PathLike, seed: int = 0, *, hidden_size: int = 64,
                   num_layers: int = 2, vision_depth: int = 2, vision_width: int = 32, patch_size: int | None = None,
                   corpus: Iterable[str] = (),
                   tags: Sequence[str] = (), pixel_mean: Sequence[float] | None = None,
                   pixel_std: Sequence[float] | None = None) -> Path:
    """Write a tiny random ``kind`` (one of :data:`KINDS`) checkpoint + processor to ``directory``.
    ``hidden_size`` (a multiple of 64) and ``num_layers`` size the language model (the benchmark uses wider),
    ``vision_depth``, ``vision_width`` and ``patch_size`` (pixels, by default the real model's: 14, 16 for
    Qwen3-VL; 2x2 patches merge into one token, so set the pipeline's ``video.size_factor`` to twice it) the
    vision tower;
    ``corpus`` and ``tags`` go to :func:`build_tokenizer`; ``pixel_mean`` / ``pixel_std`` (per RGB channel, pixels
    in 0..1) replace the processors' default CLIP normalisation."""
    from transformers import (
        AutoModelForImageTextToText,
        Qwen2_5_VLProcessor,
        Qwen2VLImageProcessor,
        Qwen2VLProcessor,
        Qwen2VLVideoProcessor,
        Qwen3VLProcessor,
        Qwen3VLVideoProcessor,
    )

    if kind not in KINDS:
        raise ValueError(f"unknown tiny VLM kind '{kind}' (known: {', '.join(KINDS)})")
    if hidden_size % 64:
        raise ValueError(f"hidden_size must be a multiple of 64, got {hidden_size}")
    directory = Path(directory)
    patch_size = patch_size or (16 if kind == "qwen3_vl" else 14)
    tokenizer = build_tokenizer(corpus, tags)
    token_ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    vocab_size = -(-len(tokenizer) // 16) * 16  # padded like the real checkpoints; rows past the tokenizer unused
    config = tiny_config(kind, token_ids, vocab_size, hidden_size, num_layers, vision_depth, vision_width, patch_size)
    with torch.random.fork_rng(devices=[]):  # leaves the caller's RNG stream untouched
        torch.manual_seed(seed)
        model = AutoModelForImageTextToText.from_config(config)
    model.generation_config.eos_token_id = [token_ids["<|im_end|>"], token_ids["<|endoftext|>"]]
    model.generation_config.pad_token_id = token_ids["<|endoftext|>"]
    norm = {"image_mean": list(pixel_mean), "image_std": list(pixel_std)} if pixel_mean and pixel_std else {}
    image_processor = Qwen2VLImageProcessor(size={"shortest_edge": 4 * 28 * 28, "longest_edge": 256 * 28 * 28},
                                            patch_size=patch_size, **norm)
    video_cls = Qwen3VLVideoProcessor if kind == "qwen3_vl" else Qwen2VLVideoProcessor
    video_processor = video_cls(size={"shortest_edge": 4 * 28 * 28, "longest_edge": 128 * 28 * 28},
                                patch_size=patch_size, **norm)
    processor_cls = {"qwen2_vl": Qwen2VLProcessor, "qwen2_5_vl": Qwen2_5_VLProcessor,
                     "qwen3_vl": Qwen3VLProcessor}[kind]
    processor = processor_cls(image_processor=image_processor, tokenizer=tokenizer,
                              video_processor=video_processor, chat_template=CHAT_TEMPLATE)
    model.save_pretrained(directory)
    processor.save_pretrained(directory)
    return directory


def cache_root() -> Path:
    """``$MMGRPO_CACHE`` or ``~/.cache/mmgrpo``."""
    return Path(os.environ.get("MMGRPO_CACHE") or Path.home() / ".cache" / "mmgrpo")


def tiny_path(kind: str) -> Path:
    """The cached tiny checkpoint folder for ``kind``, built on first use (built aside, then renamed into place)
    under the installed transformers, whose version names the folder: a checkpoint saved by one release may not
    load in another."""
    import transformers

    target = cache_root() / "tiny" / f"{kind}-{VERSION}-transformers{transformers.__version__}"
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{kind}-", dir=target.parent))
    try:
        build_tiny_vlm(kind, staging)
        os.rename(staging, target)
    except OSError:
        if not target.is_dir():  # a concurrent builder did not win the race: a real failure
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
