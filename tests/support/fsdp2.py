"""Shared by the FSDP2 checks that ``accelerate launch`` runs in two gloo processes."""

import json
import os
import sys

from accelerate.state import AcceleratorState, PartialState
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
from omegaconf import OmegaConf

from mmgrpo.trainer import Trainer, make_accelerator

STATE_DICT_TYPE = OmegaConf.load("configs/accelerate/fsdp.yaml").fsdp_config.fsdp_state_dict_type
"""configs/accelerate/fsdp.yaml's state dict type (run from the repository root)."""


def fsdp2_trainer(cfg) -> Trainer:
    """A Trainer on an accelerator whose distributed type is FSDP (FSDP2), as a GPU launch of fsdp.yaml makes it:
    accelerate turns FSDP on for GPU launches only, so the type and an FSDP2 plugin configured as fsdp.yaml
    configures it (TRANSFORMER_BASED_WRAP, resharding after forward) are set here; the rest is accelerate's own."""
    acc = make_accelerator(cfg)
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
                                            reshard_after_forward=True, state_dict_type=STATE_DICT_TYPE)
    for shared in (PartialState._shared_state, AcceleratorState._shared_state):
        shared["distributed_type"] = DistributedType.FSDP
    AcceleratorState._shared_state["fsdp_plugin"] = plugin
    trainer = Trainer(cfg, accelerator=acc)
    assert trainer.accelerator.is_fsdp2
    return trainer


def write_report_and_exit(acc, report: dict, out_path: str) -> None:
    """The main process writes ``report`` as JSON to ``out_path``; then every process leaves without tearing
    down: under load a sharded gloo group's threads can abort the interpreter's exit ("terminate called without
    an active exception") after the report is written and every check has passed."""
    if acc.is_main_process:
        with open(out_path, "w") as f:
            json.dump(report, f)
    acc.wait_for_everyone()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
