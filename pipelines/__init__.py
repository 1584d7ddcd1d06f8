"""Pipelines: each registers its config schema and policy factory in ``PIPELINES``.

The config classes import nothing heavy; diffusers and transformers are imported only when a policy is built.
"""

from __future__ import annotations

from mmgrpo.policy import PipelineSpec, Policy
from mmgrpo.registry import PIPELINES

from .flow.config import FlowConfig
from .vlm.config import VLMConfig


def build_flow_policy(cfg: FlowConfig) -> Policy:
    from .flow.policy import FlowPolicy

    return FlowPolicy(cfg)


def build_vlm_policy(cfg: VLMConfig) -> Policy:
    from .vlm.policy import VLMPolicy

    return VLMPolicy(cfg)


PIPELINES.register("flow", PipelineSpec(FlowConfig, build_flow_policy,
                                        "flow-matching image/video generators (SD3.x, FLUX.1, Wan)"))
PIPELINES.register("vlm", PipelineSpec(VLMConfig, build_vlm_policy,
                                       "vision-language reasoners on images and videos (Qwen2-VL family)"))

