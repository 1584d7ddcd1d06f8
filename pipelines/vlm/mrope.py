"""Qwen2-VL / Qwen2.5-VL M-RoPE positions by the rule the models were trained with.

Text tokens get one position on all three axes (temporal, height, width), counting up by 1. A vision block (the
run of ``<|image_pad|>`` or ``<|video_pad|>`` tokens of one image or video, ``t x h x w`` after merging
``spatial_merge_size`` x ``spatial_merge_size`` patches) starts at the next free position ``s``: token
``(i, j, k)`` sits at ``(s + floor(i * interval), s + j, s + k)``. Text after the block resumes at the block's
largest position + 1. This is the rule of Qwen's own code, transformers 4.x and vLLM; transformers 5.x's
``get_rope_index`` resumes at ``s + max(h, w)`` instead, which overlaps the block's temporal positions whenever the
last one, ``floor((t - 1) * interval)``, is ``max(h, w)`` or more (the rules agree otherwise).
"""

from __future__ import annotations

import torch

MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl")
"""``config.model_type`` values whose positions :func:`qwen_vl_positions` computes."""

RULE_ATTRIBUTE = "mmgrpo_mrope_rule"
"""The attribute of a Qwen2-VL / Qwen2.5-VL model config (a key of its ``config.json``) that names the rule the
checkpoint was trained under: ``original`` (the default when it is absent, as in every released checkpoint) or
``transformers`` (the installed transformers' ``get_rope_index``: the shipped tiny demo model was fine-tuned under
transformers 5.x's). It is saved with the checkpoints mmgrpo writes, so a model keeps its rule."""

RULES = ("original", "transformers")


def uses_original_rule(config) -> bool:
    """Whether a model with this config takes :func:`config_positions`: a Qwen2-VL / Qwen2.5-VL whose config does
    not name the ``transformers`` rule (:data:`RULE_ATTRIBUTE`). Another rule name is a ValueError naming it."""
    if config.model_type not in MODEL_TYPES:
        return False
    rule = getattr(config, RULE_ATTRIBUTE, "original")
    if rule not in RULES:
        raise ValueError(f"the model config's {RULE_ATTRIBUTE} is {rule!r}; it must be one of {', '.join(RULES)}")
    return rule == "original"


def vision_block_positions(start: int, grid_thw: torch.Tensor, spatial_merge_size: int,
                           interval: float) -> torch.Tensor:
    """(3, t*h*w) int64 positions of one vision block whose patch grid is ``grid_thw`` (3,) = (T, H, W) patches
    (h = H / spatial_merge_size, w likewise; t = T), in the token order of the vision tower (temporal, then
    rows, then columns). ``interval``: temporal positions per temporal patch; quantised after the multiply."""
    t, h, w = int(grid_thw[0]), int(grid_thw[1]) // spatial_merge_size, int(grid_thw[2]) // spatial_merge_size
    temporal = (torch.arange(t, dtype=torch.float64) * interval).floor().long()
    grid = torch.meshgrid(temporal, torch.arange(h), torch.arange(w), indexing="ij")
    return torch.stack(grid).reshape(3, -1) + start


def qwen_vl_positions(input_ids: torch.Tensor, image_grid_thw: torch.Tensor | None,
                      video_grid_thw: torch.Tensor | None, second_per_grid_ts: torch.Tensor | None, *,
                      image_token_id: int, video_token_id: int, spatial_merge_size: int,
                      tokens_per_second: float | None) -> torch.Tensor:
    """(3, 1, P) int64 M-RoPE positions of one prompt, ``input_ids`` (1, P), on its device.

    ``image_grid_thw`` (n_img, 3) / ``video_grid_thw`` (n_vid, 3): patch grids of the images / videos in prompt
    order. A video's temporal step is ``tokens_per_second * second_per_grid_ts[v]`` (Qwen2.5-VL:
    ``vision_config.tokens_per_second`` and seconds per temporal patch, 1.0 if not given); with
    ``tokens_per_second`` None (Qwen2-VL) it is 1. An image is one temporal patch (t = 1), step 1. Raises
    ValueError when the placeholder runs do not match the grids."""
    ids = input_ids[0].tolist()
    grids = {image_token_id: list(image_grid_thw if image_grid_thw is not None else []),
             video_token_id: list(video_grid_thw if video_grid_thw is not None else [])}
    seconds = list(second_per_grid_ts.tolist()) if second_per_grid_ts is not None else []
    parts, cursor, next_pos, videos = [], 0, 0, 0
    while cursor < len(ids):
        first = next((i for i in range(cursor, len(ids)) if ids[i] in grids), len(ids))
        if first > cursor:  # a text run
            parts.append(torch.arange(next_pos, next_pos + first - cursor).expand(3, -1))
            next_pos += first - cursor
        if first == len(ids):
            break
        token = ids[first]
        if not grids[token]:
            kind = "image" if token == image_token_id else "video"
            raise ValueError(f"M-RoPE: more {kind} placeholder blocks than {kind} grids")
        grid = grids[token].pop(0)
        interval = 1.0
        if token == video_token_id:
            if tokens_per_second is not None:
                interval = tokens_per_second * (seconds[videos] if videos < len(seconds) else 1.0)
            videos += 1
        block = vision_block_positions(next_pos, grid, spatial_merge_size, interval)
        if ids[first:first + block.shape[1]] != [token] * block.shape[1]:
            raise ValueError(f"M-RoPE: a placeholder run at token {first} does not hold the {block.shape[1]} "
                             f"tokens of its grid {[int(g) for g in grid]}")
        parts.append(block)
        next_pos = int(block.max()) + 1
        cursor = first + block.shape[1]
    if any(grids.values()):
        raise ValueError("M-RoPE: more image/video grids than placeholder blocks")
    return torch.cat(parts, dim=1)[:, None].to(input_ids.device)


def config_positions(config, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """:func:`qwen_vl_positions` of one prompt's processor ``inputs`` (``input_ids`` (1, P), grids,
    ``second_per_grid_ts``) with the token ids, merge size and (Qwen2.5-VL) ``vision_config.tokens_per_second``
    of a Qwen2-VL / Qwen2.5-VL model ``config``. (3, 1, P) int64."""
    vision = config.vision_config
    return qwen_vl_positions(inputs["input_ids"], inputs.get("image_grid_thw"), inputs.get("video_grid_thw"),
                             inputs.get("second_per_grid_ts"), image_token_id=config.image_token_id,
                             video_token_id=config.video_token_id, spatial_merge_size=vision.spatial_merge_size,
                             tokens_per_second=vision.tokens_per_second if config.model_type == "qwen2_5_vl"
                             else None)
