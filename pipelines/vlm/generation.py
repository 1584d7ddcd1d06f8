"""Group sampling: G completions of a prompt with the prompt prefilled once.

``generate_groups`` prefills the prompts of up to ``generation.batch_rows`` rows together (text + vision tokens,
vision tower included; left-padded to the longest, the padding masked), each once, and samples token by token
with all those groups in one batch, so a step costs one prefill call and one model call per token instead of one
of each per prompt. Each group shares its prompt's KV cache: one cache row per prompt that the G samples' tokens
are packed behind under a block mask (:class:`PackedSteps`), or, for models whose layers or attention kernel
cannot take that mask, the cache repeated to the G rows (:class:`RowSteps`). ``generate_group`` is one prompt;
``generate_group_naive`` prefills the prompt G times (what TRL does) and is kept as the benchmark baseline. All
share the decoding loop: temperature / top-k / top-p sampling from a ``torch.Generator``, vision special tokens
(and embedding rows past the tokenizer) never sampled, M-RoPE positions continuing each row's prompt, and finished
rows dropped from the batch.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from transformers.cache_utils import DynamicLayer

from mmgrpo.pipelines.vlm.config import VLMGenerationConfig
from mmgrpo.pipelines.vlm.logprobs import gather_logprobs, prompt_positions, vision_inputs
from mmgrpo.pipelines.vlm.model import VLMModel, unwrap


@dataclass
class Completions:
    """G sampled completions of one prompt.

    - ``ids``: (G,L) int64, right-padded with the pad id; L is the longest completion.
    - ``mask``: (G,L) bool, the real tokens, including the EOS token when one was produced.
    - ``truncated``: (G,) bool, hit ``max_new_tokens`` without EOS.
    - ``texts``: decoded, special tokens stripped, after the tag the prompt left open
      (``VLMModel.completion_lead``, e.g. ``<think>\\n``; usually none): the completions as the model wrote them.
    - ``logprobs``: (G,L) fp32 log-probs of the sampled tokens under the model at :func:`scoring_temperature` (no
      suppression, top-k or top-p) from the incremental KV-cache path, 0 where masked. For diagnostics only: these
      differ slightly from a full forward, so the trainer takes the old log-probs from ``token_logprobs`` and logs
      the gap (``logp/rollout_vs_recompute_max_dev``).
    """

    ids: torch.Tensor
    mask: torch.Tensor
    truncated: torch.Tensor
    texts: list[str]
    logprobs: torch.Tensor

    def rows(self, start: int, stop: int) -> Completions:
        """Rows ``start:stop``, trimmed to their longest completion."""
        width = max(int(self.mask[start:stop].sum(1).max()), 1)
        return Completions(ids=self.ids[start:stop, :width], mask=self.mask[start:stop, :width],
                           truncated=self.truncated[start:stop], texts=self.texts[start:stop],
                           logprobs=self.logprobs[start:stop, :width])


class BufferLayer(DynamicLayer):
    """A KV-cache layer that writes new tokens into a preallocated (B,H,capacity,D) buffer and returns views of it,
    instead of concatenating the whole cache at every step."""

    def __init__(self, key_buffer: torch.Tensor, value_buffer: torch.Tensor, length: int):
        super().__init__()
        self.key_buffer, self.value_buffer = key_buffer, value_buffer
        self.dtype, self.device, self.is_initialized = key_buffer.dtype, key_buffer.device, True
        self._view(length)

    @classmethod
    def from_prefixes(cls, prefixes: list[tuple[torch.Tensor, torch.Tensor, int]], capacity: int) -> BufferLayer:
        """One buffer for the rows of several prompts: each (keys, values, rows) prefix, keys (1 or rows,H,L,D), is
        repeated to its rows and right-aligned at the end of the longest prefix, so every row appends at the same
        column; the columns before a shorter prefix are zeros that the caller masks."""
        length = max(keys.shape[-2] for keys, _, _ in prefixes)
        keys0, values0, _ = prefixes[0]
        total = sum(rows for _, _, rows in prefixes)
        key_buffer = keys0.new_zeros(total, keys0.shape[1], capacity, keys0.shape[3])
        value_buffer = values0.new_zeros(total, values0.shape[1], capacity, values0.shape[3])
        row = 0
        for keys, values, rows in prefixes:
            start = length - keys.shape[-2]
            key_buffer[row:row + rows, :, start:length] = keys  # broadcasts a batch-1 prefix to the rows
            value_buffer[row:row + rows, :, start:length] = values
            row += rows
        return cls(key_buffer, value_buffer, length)

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


Generators = torch.Generator | list[torch.Generator] | None
"""What sampling draws from: one generator for the whole batch, or one per row (a row's tokens then depend only on
its own generator, not on the other rows), or None (the global RNG)."""


def scoring_temperature(cfg: VLMGenerationConfig) -> float:
    """The temperature sampled tokens are scored at: the sampling one, or 1 for greedy decoding."""
    return cfg.temperature if cfg.temperature > 0 else 1.0


def check_finite(logits: torch.Tensor) -> None:
    """Raise FloatingPointError naming the rows of ``logits`` (B,V) that hold NaN or +inf (-inf is a
    probability of 0)."""
    bad = (~(logits < float("inf"))).any(-1).nonzero()[:, 0].tolist()  # NaN < inf is False
    if bad:
        raise FloatingPointError(f"the model's next-token logits are not finite in {len(bad)} of {len(logits)} rows "
                                 f"(row {', '.join(map(str, bad[:5]))}): the forward overflowed or the weights hold "
                                 f"NaN (float16 overflows easily: try model.dtype=bfloat16)")


def sample_tokens(logits: torch.Tensor, suppress: torch.Tensor, cfg: VLMGenerationConfig,
                  generator: Generators) -> torch.Tensor:
    """One token per row from logits (B,V) fp32: ``suppress`` ids get -inf, then temperature (<= 0 is greedy),
    top-k, top-p. ``generator``: one for the batch, or a list of B, one per row. Returns (B,) int64. A row
    holding NaN or +inf is a FloatingPointError (:func:`check_finite`; greedy decoding would pick that entry)."""
    check_finite(logits)
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
    probs = logits.softmax(-1)
    if isinstance(generator, list):  # B may be 0: every row ended while another process decodes on
        return torch.cat([torch.multinomial(row, 1, generator=g) for row, g in zip(probs, generator)]
                         + [probs.new_empty(0, dtype=torch.long)])
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


@functools.cache
def cache_argument(model_class: type) -> str:
    """Name of the KV-cache argument of ``model_class.forward`` and field of its output: ``cache`` in recent
    transformers (which deprecates ``past_key_values``), ``past_key_values`` before."""
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"


def base_class(model: torch.nn.Module) -> type:
    """The transformers class under a PEFT wrapper."""
    return type(model.get_base_model() if hasattr(model, "get_base_model") else model)


def full_attention_only(vlm: VLMModel) -> bool:
    """Whether every decoder layer attends to the whole sequence (no sliding-window layers), so that prompts of
    different lengths can share one left-padded prefill."""
    config = unwrap(vlm.model).config
    layer_types = getattr(getattr(config, "text_config", config), "layer_types", None) or ()
    return all(kind == "full_attention" for kind in layer_types)


def takes_block_mask(vlm: VLMModel) -> bool:
    """Whether decoding can pack a group into one cache row (:class:`PackedSteps`): every layer attends to the
    whole sequence and the attention kernel takes a 4-D mask (sdpa or eager; flash_attention_2 does not)."""
    return full_attention_only(vlm) and unwrap(vlm.model).config._attn_implementation in ("sdpa", "eager")


class RowSteps:
    """Decoding with one cache row per sample: each step feeds every row's token (B,1) at the row's next
    position. Finished rows leave the batch one by one (``block`` = 1)."""

    block = 1

    def __init__(self, cache, next_position: torch.Tensor, attention_mask: torch.Tensor | None):
        """``next_position`` (lead,B,1): each row's first completion position; ``attention_mask`` (B,capacity)
        hides cache columns (left padding), or None when nothing is padded."""
        self.cache, self.position, self.attention_mask = cache, next_position, attention_mask
        self.prefix = cache.get_seq_length()

    def forward(self, vlm: VLMModel, token: torch.Tensor, t: int) -> torch.Tensor:
        """Logits (B,V) fp32 after feeding ``token`` (B,), completion token ``t`` of every row."""
        position = self.position + t
        columns = self.prefix + t + 1
        extra = {} if self.attention_mask is None else {"attention_mask": self.attention_mask[:, :columns]}
        return vlm.model(input_ids=token[:, None], position_ids=position if len(position) == 3 else position[0],
                         use_cache=True, **{cache_argument(base_class(vlm.model)): self.cache},
                         **extra).logits[:, -1].float()

    def select(self, keep: torch.Tensor) -> None:
        """Keep rows ``keep`` (k,) of the batch."""
        self.position = self.position[:, keep]
        self.attention_mask = None if self.attention_mask is None else self.attention_mask[keep]
        self.cache.batch_select_indices(keep)


class PackedSteps:
    """Decoding with one cache row per prompt, holding ``[prompt; step-0 tokens of its G samples; step-1 tokens;
    ...]``, so the prompt's keys and values are stored, and read at every step, once per group instead of G
    times. Each step feeds the G tokens of each prompt as one (n,G) block at the same position, and a block mask
    lets every token see its prompt (without the left padding) and its own sample's tokens only: each sample
    attends to what it would with a cache row of its own. A group leaves the batch when all its samples have
    ended (``block`` = G); until then its ended samples are fed padding that no other token sees."""

    def __init__(self, cache, next_position: torch.Tensor, keep: torch.Tensor, group: int, capacity: int,
                 dtype: torch.dtype):
        """``next_position`` (lead,n,1): each prompt's first completion position; ``keep`` (n,P): 1 on the prompt's
        own columns, 0 on its left padding; ``capacity``: cache columns (P + G * max_new_tokens); ``dtype``: the
        model's, for the additive mask."""
        self.cache, self.position, self.block = cache, next_position, group
        self.prefix = keep.shape[1]
        column = torch.arange(capacity, device=keep.device)
        sample = torch.arange(group, device=keep.device)[:, None]
        own = (column >= self.prefix) & ((column - self.prefix) % group == sample)  # (G,capacity)
        visible = own.expand(len(keep), -1, -1).clone()
        visible[..., :self.prefix] = keep.bool()[:, None]
        self.bias = torch.zeros(visible.shape, dtype=dtype, device=keep.device).masked_fill_(
            ~visible, torch.finfo(dtype).min)[:, None]  # (n,1,G,capacity)

    def forward(self, vlm: VLMModel, token: torch.Tensor, t: int) -> torch.Tensor:
        """Logits (n*G,V) fp32 after feeding ``token`` (n*G,), completion token ``t`` of every sample."""
        prompts = self.position.shape[1]
        position = (self.position + t).expand(-1, -1, self.block)
        columns = self.prefix + self.block * (t + 1)
        logits = vlm.model(input_ids=token.view(prompts, self.block),
                           position_ids=position if len(position) == 3 else position[0],
                           attention_mask=self.bias[..., :columns], use_cache=True,
                           **{cache_argument(base_class(vlm.model)): self.cache}).logits
        return logits.reshape(prompts * self.block, -1).float()

    def select(self, keep: torch.Tensor) -> None:
        """Keep rows ``keep`` (k,) of the batch: whole groups, in order."""
        prompts = keep[::self.block] // self.block
        self.position, self.bias = self.position[:, prompts], self.bias[prompts]
        self.cache.batch_select_indices(prompts)


def prefill(vlm: VLMModel, prompts: list[dict[str, torch.Tensor]], rows: int, shared: bool,
            max_new_tokens: int) -> tuple[torch.Tensor, RowSteps | PackedSteps]:
    """Prompt forward for ``rows`` samples of each of ``prompts`` (batch-1 inputs from ``VLMModel.prompt_inputs``).

    ``shared``: the prompts, left-padded to the longest, run together once (vision tower included), and each
    cache serves its ``rows`` samples: packed into one row per prompt (:class:`PackedSteps`) where the model
    takes a block mask, else repeated to the rows. Otherwise one prompt runs on ``rows`` copies (the benchmark
    baseline). Full-attention cache layers move into buffers with room for the completions. Returns (next-token
    logits (n*rows,V) fp32, decoding state); rows are grouped by prompt, in order."""
    if not shared and len(prompts) != 1:
        raise ValueError(f"an unshared prefill takes one prompt, got {len(prompts)}")
    model = vlm.model
    lengths = [p["input_ids"].shape[1] for p in prompts]
    length = max(lengths)
    padded = min(lengths) < length
    if padded and not full_attention_only(vlm):
        raise ValueError("prompts of different lengths cannot share a prefill with sliding-window layers")
    own_positions = [prompt_positions(model, p) for p in prompts]
    lead = own_positions[0].shape[0]
    ids = prompts[0]["input_ids"].new_full((len(prompts), length), vlm.pad_token_id)
    positions = own_positions[0].new_zeros(lead, len(prompts), length)
    keep = torch.zeros(len(prompts), length, dtype=torch.long, device=ids.device)
    for i, (p, own, n) in enumerate(zip(prompts, own_positions, lengths)):  # left padding: the last n columns
        ids[i, length - n:] = p["input_ids"][0]
        positions[:, i, length - n:] = own[:, 0]
        keep[i, length - n:] = 1
    copies = 1 if shared else rows
    batch = copies * len(prompts)  # copies > 1 only with one prompt
    position_ids = positions.expand(-1, batch, -1)
    out = model(input_ids=ids.expand(batch, -1), position_ids=position_ids if lead == 3 else position_ids[0],
                attention_mask=keep if padded else None, use_cache=True, logits_to_keep=1,
                **vision_inputs(prompts * copies))
    cache = getattr(out, cache_argument(base_class(model)))
    packed = shared and rows > 1 and takes_block_mask(vlm) and all(type(x) is DynamicLayer for x in cache.layers)
    capacity = length + max_new_tokens * (rows if packed else 1)
    for i, layer in enumerate(cache.layers):
        if type(layer) is DynamicLayer:
            if packed or not shared:
                prefixes = [(layer.keys, layer.values, len(layer.keys))]
            else:
                prefixes = [(layer.keys[j:j + 1], layer.values[j:j + 1], rows) for j in range(len(prompts))]
            cache.layers[i] = BufferLayer.from_prefixes(prefixes, capacity)
        elif shared:
            layer.batch_repeat_interleave(rows)
    logits = out.logits[:, -1].float().repeat_interleave(rows if shared else 1, dim=0)
    next_position = positions[..., -1:] + 1
    if packed:
        return logits, PackedSteps(cache, next_position, keep, rows, capacity, next(model.parameters()).dtype)
    attention = None
    if padded:
        attention = torch.ones(len(logits), capacity, dtype=torch.long, device=logits.device)
        attention[:, :length] = keep.repeat_interleave(rows, dim=0)
    return logits, RowSteps(cache, next_position.repeat_interleave(rows, dim=1), attention)


@torch.no_grad()
def decode(vlm: VLMModel, logits: torch.Tensor, steps: RowSteps | PackedSteps, cfg: VLMGenerationConfig,
           generator: Generators, synced: Callable[[bool], bool] | None = None) -> Completions:
    """Sample from the prefill ``logits`` (B,V) on, feeding each token back through ``steps``. Rows stop at EOS or
    at ``cfg.max_new_tokens``; finished rows sample nothing more, and leave the batch in ``steps.block``-sized
    blocks once the whole block has finished. ``generator``: see :data:`Generators` (a list: B, in row order).

    ``synced`` (sharded parameters, where every forward gathers weights from all processes): called once per
    token with whether this process has rows left to decode, it returns whether any process has. Finished rows
    then stay in the batch, fed padding and sampling nothing, and decoding goes on until every process is done,
    so all processes run the same number of forwards."""
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
    """The rows of the batch, as indices into the group."""
    for t in range(limit):
        live = ~finished[alive]
        rows, live_logits = (alive, logits) if live.all() else (alive[live], logits[live])
        own = [generator[r] for r in rows.tolist()] if isinstance(generator, list) else generator
        sampled = sample_tokens(live_logits, suppress, cfg, own)
        tokens[rows, t] = sampled
        logps[rows, t] = gather_logprobs(live_logits, sampled, scoring_temperature(cfg))
        lengths[rows] = t + 1
        finished[rows[torch.isin(sampled, eos)]] = True
        token = torch.full_like(alive, vlm.pad_token_id).masked_scatter(live, sampled)  # finished rows: padding
        unfinished = ~finished[alive]
        if synced is None and not unfinished.all():
            keep = unfinished.view(-1, steps.block).any(1).repeat_interleave(steps.block).nonzero()[:, 0]
            if len(keep) == 0:
                break
            if len(keep) < len(alive):
                alive, token = alive[keep], token[keep]
                steps.select(keep)
        if t == limit - 1:
            break
        more = bool(unfinished.any())
        if not (more if synced is None else synced(more)):
            break
        logits = steps.forward(vlm, token, t)
    width = int(lengths.max())
    mask = torch.arange(width, device=device) < lengths[:, None]
    ids = tokens[:, :width]
    texts = [vlm.completion_lead + text for text in vlm.tokenizer.batch_decode(
        [row[:n] for row, n in zip(ids.tolist(), lengths.tolist())], skip_special_tokens=True)]
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
def generate_groups(vlm: VLMModel, prompts: list[dict[str, torch.Tensor]], group_size: int,
                    gen_cfg: VLMGenerationConfig, generator: Generators = None,
                    synced: Callable[[bool], bool] | None = None) -> list[Completions]:
    """``group_size`` completions of each prompt (batch-1 ``inputs`` from ``VLMModel.prompt_inputs``): each prompt
    and its vision inputs prefilled once with the KV cache shared across its group, and the groups decoded
    together, ``gen_cfg.batch_rows`` rows at a time (0: one group at a time; a group is never split).
    ``generator``: see :data:`Generators` (a list: one per completion, ``len(prompts) * group_size``, grouped).
    ``synced``: see :func:`decode` (every process must pass the same number of prompts)."""
    per_call = max(1, gen_cfg.batch_rows // group_size)
    if not full_attention_only(vlm):
        per_call = 1  # sliding-window caches cannot be left-padded
    out = []
    with eval_mode(vlm.model):
        for start in range(0, len(prompts), per_call):
            logits, steps = prefill(vlm, prompts[start:start + per_call], group_size, True, gen_cfg.max_new_tokens)
            rows = slice(start * group_size, (start + per_call) * group_size)
            batch = decode(vlm, logits, steps, gen_cfg, generator[rows] if isinstance(generator, list) else generator,
                           synced)
            out += [batch.rows(r, r + group_size) for r in range(0, len(batch.texts), group_size)]
    return out


def generate_group(vlm: VLMModel, inputs: dict[str, torch.Tensor], group_size: int, gen_cfg: VLMGenerationConfig,
                   generator: torch.Generator | None = None,
                   synced: Callable[[bool], bool] | None = None) -> Completions:
    """``group_size`` completions of one prompt (:func:`generate_groups`)."""
    return generate_groups(vlm, [inputs], group_size, gen_cfg, generator, synced)[0]


@torch.no_grad()
def generate_group_naive(vlm: VLMModel, inputs: dict[str, torch.Tensor], group_size: int,
                         gen_cfg: VLMGenerationConfig, generator: torch.Generator | None = None) -> Completions:
    """Baseline with the same sampling: the prompt repeated ``group_size`` times and prefilled on every copy."""
    with eval_mode(vlm.model):
        logits, steps = prefill(vlm, [inputs], group_size, False, gen_cfg.max_new_tokens)
        return decode(vlm, logits, steps, gen_cfg, generator)
