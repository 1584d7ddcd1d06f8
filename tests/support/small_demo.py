"""The demos shrunk to seconds for the tests: 3 held-out prompts, 2 validation ones, one check per step, and
small steps (2 prompts x 4 samples)."""

import dataclasses

from mmgrpo import demo

SMALL = ["data.num_eval=3", "train.prompts_per_step=2", "train.group_size=4", "train.micro_batch_size=8",
         "num_threads=1"]


SAMPLES_PER_PROMPT = {"flow": 2, "vlm": 1}
"""Held-out samples per prompt: flow needs two for its diversity measure."""


def shrink(which: str) -> demo.DemoSpec:
    """``demo.DEMOS[which]`` shrunk. One process, so that ``mmgrpo demo`` runs it in the calling process."""
    return dataclasses.replace(demo.DEMOS[which], overrides=SMALL, samples_per_prompt=SAMPLES_PER_PROMPT[which],
                               num_val=2, eval_every=1, num_processes=1)
