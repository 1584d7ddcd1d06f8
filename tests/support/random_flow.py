"""Overrides that put a tiny flow preset on the random tiny SD3 (``tiny:sd3``, 32x32) with the colour prompts and
a colour reward: the unit tests' setting, fast, with rewards that vary for a random model, independent of the
shipped ShapesT2I model the presets train."""

RANDOM_TINY_SD3 = [
    "model.path=tiny:sd3", "model.max_sequence_length=32", "sampling.height=32", "sampling.width=32",
    "data.train_prompts=configs/flow/prompts/colors_train.jsonl",
    "data.eval_prompts=configs/flow/prompts/colors_eval.jsonl", "data.num_eval=4",
    "rewards=[{name: color_fraction, weight: 1.0, args: {tolerance: 0.5}}, {name: jpeg_compressibility, weight: 0.1}]",
]
"""Relative prompt paths: run from the repository root."""


def every_third_group_brightness(batch) -> list[float]:
    """Mean brightness of the samples of the groups whose global id is 1 modulo 3, 0 for the others: those carry
    no signal, so dynamic sampling has groups to replace
    (``rewards=[{name: "random_flow:every_third_group_brightness"}]``)."""
    brightness = batch.images.float().mean(dim=(1, 2, 3))
    return [float(b) if int(g) % 3 == 1 else 0.0 for b, g in zip(brightness, batch.group)]
