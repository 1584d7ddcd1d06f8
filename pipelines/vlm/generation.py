"""Group sampling: G completions of one prompt with the prompt prefilled once.

``generate_group`` runs the prompt (text + vision tokens, vision tower included) once at batch 1, repeats its KV
cache to the G rows, and samples token by token; ``generate_group_naive`` prefills the prompt G times (what TRL
does) and is kept as the benchmark baseline. Both share the decoding loop: temperature / top-k / top-p sampling
from a ``torch.Generator``, vision special tokens (and embedding rows past the tokenizer) never sampled, M-RoPE
positions continuing the prompt, and finished rows dropped from the batch.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from transformers.cache_utils import DynamicLayer

from mmgrpo.pipelines.vlm.config import VLMGenerationConfig
from mmgrpo.pipelines.vlm.logprobs import gather_logprobs, prompt_positions, vision_inputs
from mmgrpo.pipelines.vlm.model import VLMModel


@dataclass
class Completions:
    """G sampled completions of one prompt.

    - ``ids``: (G,L) int64, right-padded with the pad id; L is the longest completion.
    - ``mask``: (G,L) bool, the real tokens, including the EOS token when one was produced.
    - ``truncated``: (G,) bool, hit ``max_new_tokens`` without EOS.
    - ``texts``: decoded, special tokens stripped.
    - ``logprobs``: (G,L) fp32 log-probs of the sampled tokens under the model at :func:`scoring_temperature` (no
      suppression, top-k or top-p) from the incremental KV-cache path, 0 where masked. For diagnostics only: these
      differ slightly from a full forward, so the old log-probs for training come from ``token_logprobs``.
    """

    ids: torch.Tensor
    mask: torch.Tensor
    truncated: torch.Tensor
    texts: list[str]
    logprobs: torch.Tensor


class BufferLayer(DynamicLayer):
    """A KV-cache layer that writes new tokens into a preallocated (B,H,capacity,D) buffer and returns views of it,
    instead of concatenating the whole cache at every step."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, rows: int, capacity: int):
        super().__init__()
        length = keys.shape[-2]
        self.key_buffer = keys.new_empty(rows, keys.shape[1], capacity, keys.shape[3])
        self.value_buffer = values.new_empty(rows, values.shape[1], capacity, values.shape[3])
        self.key_buffer[:, :, :length] = keys  # broadcasts a batch-1 prefix to the rows
        self.value_buffer[:, :, :length] = values
        self.dtype, self.device, self.is_initialized = keys.dtype, keys.device, True
        self._view(length)

    def _view(self, length: int) -> None:
        self.length = length
        self.keys = self.key_buffer[:, :, :length]
        self.values = self.value_buffer[:, :, :length]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        end = self.length + key_states.shape[-2]
        self.key_buffer[:, :, self.length:end] = key_states
        self.value_buffer[:, :, self.length:end] = value_states
        self._view(end)
        return self.keys, self.values

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.key_buffer, self.value_buffer = self.key_buffer[indices], self.value_buffer[indices]
        self._view(self.length)


def scoring_temperature(cfg: VLMGenerationConfig) -> float:
    """The temperature sampled tokens are scored at: the sampling one, or 1 for greedy decoding."""
    return cfg.temperature if cfg.temperature > 0 else 1.0


def sample_tokens(logits: torch.Tensor, suppress: torch.Tensor, cfg: VLMGenerationConfig,
                  generator: torch.Generator | None) -> torch.Tensor:
    """One token per row from logits (B,V) fp32: ``suppress`` ids get -inf, then temperature (<= 0 is greedy),
    top-k, top-p. Returns (B,) int64."""
    logits = logits.index_fill(1, suppress, float("-inf"))
    if cfg.temperature <= 0:
        return logits.argmax(-1)
    logits = logits / cfg.temperature
    if 0 < cfg.top_k < logits.shape[1]:
        kth = logits.topk(cfg.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if cfg.top_p < 1.0:
        ordered, order = logits.sort(dim=-1, descending=True)
        probs = ordered.softmax(-1)
        drop = probs.cumsum(-1) - probs > cfg.top_p  # keeps the smallest prefix whose mass reaches top_p
        logits = torch.full_like(logits, float("-inf")).scatter(1, order, ordered.masked_fill(drop, float("-inf")))
    return torch.multinomial(logits.softmax(-1), 1, generator=generator)[:, 0]


@functools.cache
def cache_argument(model_class: type) -> str:
    """Name of the KV-cache argument of ``model_class.forward`` and field of its output: ``cache`` in recent
    transformers (which deprecates ``past_key_values``), ``past_key_values`` before."""
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"


def base_class(model: torch.nn.Module) -> type:
    """The transformers class under a PEFT wrapper."""
    return type(model.get_base_model() if hasattr(model, "get_base_model") else model)


def prefill(vlm: VLMModel, inputs: dict[str, torch.Tensor], rows: int, shared: bool, max_new_tokens: int):
    """Prompt forward for ``rows`` samples: once at batch 1 with the KV cache repeated (``shared``), or on ``rows``
    copies of the prompt. Full-attention cache layers move into buffers with room for ``max_new_tokens``.
    Returns (next-token logits (rows,V) fp32, cache, first completion position (lead,1,1))."""
    model = vlm.model
    positions = prompt_positions(model, inputs)
    copies = 1 if shared else rows
    out = model(input_ids=inputs["input_ids"].expand(copies, -1), position_ids=positions.expand(-1, copies, -1)
                if positions.shape[0] == 3 else positions[0].expand(copies, -1),
                use_cache=True, logits_to_keep=1, **vision_inputs([inputs] * copies))
    cache = getattr(out, cache_argument(base_class(model)))
    capacity = inputs["input_ids"].shape[1] + max_new_tokens
    for i, layer in enumerate(cache.layers):
        if type(layer) is DynamicLayer:
            cache.layers[i] = BufferLayer(layer.keys, layer.values, rows, capacity)
        elif shared:
            layer.batch_repeat_interleave(rows)
    logits = out.logits[:, -1].float().expand(rows, -1)
    return logits, cache, positions[..., -1:] + 1


@torch.no_grad()
def decode(vlm: VLMModel, logits: torch.Tensor, cache, next_position: torch.Tensor, cfg: VLMGenerationConfig,
           generator: torch.Generator | None) -> Completions:
    """Sample from the prefill ``logits`` (G,V) on, feeding each token back through ``cache``; rows stop at EOS
    (and leave the batch) or at ``cfg.max_new_tokens``."""
    group, vocab = logits.shape
    device = logits.device
    suppress = torch.tensor(vlm.vision_token_ids + list(range(vlm.vocab_size, vocab)), dtype=torch.long,
                            device=device)
    eos = torch.tensor(vlm.eos_token_ids, device=device)
    limit = cfg.max_new_tokens
    tokens = torch.full((group, limit), vlm.pad_token_id, dtype=torch.long, device=device)
    logps = torch.zeros(group, limit, device=device)
    lengths = torch.zeros(group, dtype=torch.long, device=device)
    finished = torch.zeros(group, dtype=torch.bool, device=device)
    alive = torch.arange(group, device=device)
    lead = next_position.shape[0]
    cache_name = cache_argument(base_class(vlm.model))
    for t in range(limit):
        token = sample_tokens(logits, suppress, cfg, generator)
        tokens[alive, t] = token
        logps[alive, t] = gather_logprobs(logits, token, scoring_temperature(cfg))
        lengths[alive] = t + 1
        done = torch.isin(token, eos)
        if done.any():
            finished[alive[done]] = True
            if done.all():
                break
            keep = (~done).nonzero()[:, 0]
            alive, token = alive[keep], token[keep]
            cache.batch_select_indices(keep)
        if t == limit - 1:
            break
        position = (next_position + t).expand(lead, len(alive), 1)
        logits = vlm.model(input_ids=token[:, None], position_ids=position if lead == 3 else position[0],
                           use_cache=True, **{cache_name: cache}).logits[:, -1].float()
    width = int(lengths.max())
    mask = torch.arange(width, device=device) < lengths[:, None]
    ids = tokens[:, :width]
    texts = vlm.tokenizer.batch_decode([row[:n] for row, n in zip(ids.tolist(), lengths.tolist())],
                                       skip_special_tokens=True)
    return Completions(ids=ids, mask=mask, truncated=~finished, texts=texts,
                       logprobs=logps[:, :width].masked_fill(~mask, 0.0))


@contextlib.contextmanager
def eval_mode(model: torch.nn.Module) -> Iterator[None]:
    """Eval mode for sampling (gradient-checkpointed layers drop the KV cache in train mode), then restored."""
    training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(training)


@torch.no_grad()
def generate_group(vlm: VLMModel, inputs: dict[str, torch.Tensor], group_size: int, gen_cfg: VLMGenerationConfig,
                   generator: torch.Generator | None = None) -> Completions:
    """``group_size`` completions of one prompt (batch-1 ``inputs`` from ``VLMModel.prompt_inputs``), the prompt
    and its vision inputs prefilled once and the KV cache shared across the group."""
    with eval_mode(vlm.model):
        return decode(vlm, *prefill(vlm, inputs, group_size, True, gen_cfg.max_new_tokens), gen_cfg, generator)


@torch.no_grad()
def generate_group_naive(vlm: VLMModel, inputs: dict[str, torch.Tensor], group_size: int,
                         gen_cfg: VLMGenerationConfig, generator: torch.Generator | None = None) -> Completions:
    """Baseline with the same sampling: the prompt repeated ``group_size`` times and prefilled on every copy."""
    with eval_mode(vlm.model):
        return decode(vlm, *prefill(vlm, inputs, group_size, False, gen_cfg.max_new_tokens), gen_cfg, generator)
