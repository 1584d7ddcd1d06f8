"""Per-token log-probs of completions under grad (and the entropy of the sampling distribution at each token):
the standard per-row forward and the Prefix Grouper.

Both compute ``log p(token t | prompt, tokens < t)`` with the pixel inputs, in fp32, and agree to float rounding
in value and parameter gradients. The Prefix Grouper packs every distinct prompt once, followed by the real
tokens of each of its completions, into one sequence; an attention mask lets each completion see its own prompt
and its own earlier tokens only, and M-RoPE positions continue the prompt for every completion. The vision tower
and the prompt tokens then run once per prompt instead of once per completion, in a single model call (so DDP,
gradient checkpointing and PEFT see an ordinary forward).
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from mmgrpo.pipelines.vlm.model import unwrap
from mmgrpo.pipelines.vlm.mrope import config_positions, uses_original_rule

BLOCK_MASK_ATTENTION = ("sdpa", "eager")
"""Attention implementations that take the Prefix Grouper's 4-D block mask."""
IMAGE_KEYS = ("pixel_values", "image_grid_thw")
VIDEO_KEYS = ("pixel_values_videos", "video_grid_thw")


def prompt_positions(model: nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """Rotary positions of one prompt: (3,1,P) int64 for M-RoPE models (temporal, height, width; text tokens have
    all three equal), else (1,1,P). Completion token t sits at ``positions[..., -1] + 1 + t``. Qwen2-VL and
    Qwen2.5-VL follow the rule they were pre-trained with (:mod:`~mmgrpo.pipelines.vlm.mrope`) unless their config
    names transformers' (:data:`~mmgrpo.pipelines.vlm.mrope.RULE_ATTRIBUTE`); other M-RoPE models use their own
    ``get_rope_index``."""
    ids = inputs["input_ids"]
    core = unwrap(model)
    rope_index = getattr(getattr(core, "model", core), "get_rope_index", None)
    if rope_index is None:
        return torch.arange(ids.shape[1], device=ids.device).expand(1, 1, -1)
    has_vision = inputs.get("image_grid_thw") is not None or inputs.get("video_grid_thw") is not None
    if not has_vision:
        return torch.arange(ids.shape[1], device=ids.device).expand(3, 1, -1)
    if uses_original_rule(core.config):
        return config_positions(core.config, inputs)
    accepted = inspect.signature(rope_index).parameters
    kwargs = {k: v for k, v in inputs.items() if k in accepted and k not in ("input_ids", "attention_mask")}
    positions, _ = rope_index(ids, **kwargs)
    return positions


def vision_inputs(prompts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The pixel tensors of ``prompts`` concatenated in order (the model fills placeholders in sequence order)."""
    out = {}
    for key in IMAGE_KEYS + VIDEO_KEYS:
        parts = [p[key] for p in prompts if p.get(key) is not None]
        if parts:
            out[key] = torch.cat(parts)
    return out


def check_prompt(model: nn.Module, inputs: dict[str, torch.Tensor], index: int) -> None:
    """Refuse a prompt whose image/video placeholder tokens have no pixel inputs (log-probs would ignore pixels)."""
    config = unwrap(model).config
    for token_key, keys in (("image_token_id", IMAGE_KEYS), ("video_token_id", VIDEO_KEYS)):
        token = getattr(config, token_key, None)
        count = int((inputs["input_ids"] == token).sum()) if token is not None else 0
        if count and any(inputs.get(k) is None for k in keys):
            raise ValueError(f"prompt {index} has {count} {token_key.removesuffix('_id')}s but no {keys[0]}; "
                             "log-probs must be computed with the pixel inputs")


def gather_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """fp32 ``log_softmax(logits / temperature)[target]``, outside any autocast. logits (..., V), targets (...) ->
    (...)."""
    with torch.autocast(logits.device.type, enabled=False):
        logits = logits.float() / temperature
        return logits.gather(-1, targets[..., None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)


ENTROPY_CHUNK = 256
"""Token positions whose softmax :func:`token_entropy` takes at once: its fp32 temporaries stay near 150 MB each at
a 152k vocabulary, however many tokens a micro-batch holds."""


@torch.no_grad()
def token_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """fp32 entropy in nats of ``softmax(logits / temperature)``, without grad: logits (n,L,V) -> (n,L), taken
    ``ENTROPY_CHUNK`` positions of a row at a time (a view of ``logits``, which is never copied whole)."""
    out = torch.empty(logits.shape[:-1], dtype=torch.float32, device=logits.device)
    with torch.autocast(logits.device.type, enabled=False):
        for i in range(logits.shape[0]):
            for start in range(0, logits.shape[1], ENTROPY_CHUNK):
                z = logits[i, start:start + ENTROPY_CHUNK].float() / temperature
                out[i, start:start + ENTROPY_CHUNK] = torch.special.entr(z.softmax(-1)).sum(-1)  # -p ln p; 0 at p=0
    return out


def token_logprobs(model: nn.Module, prompts: list[dict[str, torch.Tensor]], completion_ids: torch.Tensor,
                   completion_mask: torch.Tensor, prompt_index: torch.Tensor, prefix_grouper: bool,
                   temperature: float = 1.0) -> torch.Tensor:
    """(n,L) fp32 log-probs of ``completion_ids`` (n,L) int64 where ``completion_mask`` (n,L) bool marks the real
    tokens (a prefix of each row); row i continues ``prompts[prompt_index[i]]`` (batch-1 inputs from
    ``VLMModel.prompt_inputs``). Masked positions are 0. ``model`` is called once, as given (DDP, PEFT, or the
    adapter-disabled reference). ``temperature`` (> 0) divides the logits: the distribution sampled from."""
    return token_logprobs_and_entropy(model, prompts, completion_ids, completion_mask, prompt_index,
                                      prefix_grouper, temperature, entropy=False)[0]


def token_logprobs_and_entropy(model: nn.Module, prompts: list[dict[str, torch.Tensor]],
                               completion_ids: torch.Tensor, completion_mask: torch.Tensor,
                               prompt_index: torch.Tensor, prefix_grouper: bool, temperature: float = 1.0,
                               entropy: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`token_logprobs`, and from the same forward (with ``entropy``) the (n,L) fp32 entropy in nats of the
    distribution each token was sampled from (``softmax(logits / temperature)`` over the whole vocabulary, before
    any top-k / top-p), without grad; masked positions are 0. Else (log-probs, None)."""
    if temperature <= 0:
        raise ValueError(f"token_logprobs: temperature must be > 0, got {temperature}")
    n, length = completion_ids.shape
    mask = completion_mask.bool()
    if prompt_index.shape != (n,) or mask.shape != (n, length):
        raise ValueError(f"shapes disagree: completion_ids {(n, length)}, completion_mask {tuple(mask.shape)}, "
                         f"prompt_index {tuple(prompt_index.shape)}")
    if (mask[:, 1:] & ~mask[:, :-1]).any():
        raise ValueError("completion_mask must mark a prefix of each row (the real tokens, right-padded)")
    for j in prompt_index.unique().tolist():
        check_prompt(model, prompts[j], j)
    forward = packed_logits if prefix_grouper else standard_logits
    logits = forward(model, prompts, completion_ids, mask, prompt_index)
    logp = gather_logprobs(logits, completion_ids, temperature).masked_fill(~mask, 0.0)
    return logp, token_entropy(logits, temperature).masked_fill(~mask, 0.0) if entropy else None


def standard_logits(model: nn.Module, prompts: list[dict[str, torch.Tensor]], completion_ids: torch.Tensor,
                    mask: torch.Tensor, prompt_index: torch.Tensor) -> torch.Tensor:
    """(n,L,V) logits, those at (i, t) predicting ``completion_ids[i, t]``, from one row per completion:
    ``[left pad; prompt; completion; right pad]``, the vision inputs repeated per row."""
    n, length = completion_ids.shape
    device = completion_ids.device
    rows = prompt_index.tolist()
    width = max(prompts[j]["input_ids"].shape[1] for j in set(rows))
    positions = {j: prompt_positions(model, prompts[j]) for j in set(rows)}
    lead = positions[rows[0]].shape[0]
    ids = torch.zeros(n, width + length, dtype=torch.long, device=device)
    attention = torch.zeros(n, width + length, dtype=torch.long, device=device)
    pos = torch.zeros(lead, n, width + length, dtype=torch.long, device=device)
    steps = torch.arange(1, length + 1, device=device)
    for i, j in enumerate(rows):
        prompt = prompts[j]["input_ids"][0]
        start = width - prompt.shape[0]
        ids[i, start:width] = prompt
        attention[i, start:width] = 1
        pos[:, i, start:width] = positions[j][:, 0]
        pos[:, i, width:] = positions[j][:, 0, -1:] + steps
    ids[:, width:] = completion_ids
    attention[:, width:] = mask.long()
    logits = model(input_ids=ids, attention_mask=attention, position_ids=pos if lead == 3 else pos[0],
                   use_cache=False, logits_to_keep=length + 1,
                   **vision_inputs([prompts[j] for j in rows])).logits
    return logits[:, :-1]


def packed_logits(model: nn.Module, prompts: list[dict[str, torch.Tensor]], completion_ids: torch.Tensor,
                  mask: torch.Tensor, prompt_index: torch.Tensor) -> torch.Tensor:
    """(n,L,V) logits as :func:`standard_logits` gives them (masked positions hold some row's logits), from the
    Prefix Grouper: one sequence ``[prompt_a; its completions' real tokens; prompt_b; ...]`` in one forward."""
    attention = unwrap(model).config._attn_implementation
    if attention not in BLOCK_MASK_ATTENTION:
        raise ValueError(f"prefix_grouper needs sdpa or eager attention (it passes a block attention mask), not "
                         f"{attention}; set model.attn_implementation=sdpa or prefix_grouper=false")
    n, length = completion_ids.shape
    device = completion_ids.device
    lengths = mask.sum(1).tolist()
    order = sorted(set(prompt_index.tolist()))
    tokens, positions, group, segment = [], [], [], []
    # (row, first token's position in the packed sequence, position whose logits predict the first token)
    starts: list[tuple[int, int, int]] = []
    cursor = 0
    for g, j in enumerate(order):
        prompt = prompts[j]["input_ids"][0]
        prompt_pos = prompt_positions(model, prompts[j])[:, 0]
        tokens.append(prompt)
        positions.append(prompt_pos)
        group.append(torch.full_like(prompt, g))
        segment.append(torch.zeros_like(prompt))
        last = cursor + prompt.shape[0] - 1
        cursor += prompt.shape[0]
        for i in (prompt_index == j).nonzero()[:, 0].tolist():
            k = lengths[i]
            tokens.append(completion_ids[i, :k])
            positions.append(prompt_pos[:, -1:] + torch.arange(1, k + 1, device=device))
            group.append(torch.full((k,), g, device=device))
            segment.append(torch.full((k,), i + 1, device=device))
            starts.append((i, cursor, last))
            cursor += k
    ids = torch.cat(tokens)[None]
    pos = torch.cat(positions, dim=1)[:, None]
    group_ids, segment_ids = torch.cat(group), torch.cat(segment)
    causal = torch.ones(cursor, cursor, dtype=torch.bool, device=device).tril()
    visible = causal & (group_ids[:, None] == group_ids[None]) \
        & ((segment_ids[None] == 0) | (segment_ids[:, None] == segment_ids[None]))
    dtype = next(model.parameters()).dtype
    bias = torch.zeros(1, 1, cursor, cursor, dtype=dtype, device=device)
    bias.masked_fill_(~visible, torch.finfo(dtype).min)

    # Position in the packed sequence whose logits predict completion token (i, t); -1 where masked.
    source = torch.full((n, length), -1, dtype=torch.long, device=device)
    for i, first, last in starts:
        k = lengths[i]
        if k:
            source[i, 0] = last
            source[i, 1:k] = torch.arange(first, first + k - 1, device=device)
    keep = source[source >= 0].unique() if mask.any() else source.new_zeros(1)  # keeps the graph when all empty
    logits = model(input_ids=ids, attention_mask=bias, position_ids=pos if pos.shape[0] == 3 else pos[0],
                   use_cache=False, logits_to_keep=keep,
                   **vision_inputs([prompts[j] for j in order])).logits[0]
    row_of = torch.searchsorted(keep, source.clamp(min=0))
    return logits[row_of]
