"""Run under ``accelerate launch`` with two gloo processes (configs/accelerate/cpu_2proc.yaml): saving and resuming
the tiny SD3 (``tiny:sd3``) trained under accelerate's FSDP2, as a full fine-tune and with LoRA. accelerate turns
FSDP on for GPU launches only (``Accelerator(cpu=True)`` keeps a MULTI_CPU run), so this sets its distributed type
to FSDP with an FSDP2 plugin as configs/accelerate/fsdp.yaml configures it (TRANSFORMER_BASED_WRAP, resharding after
forward, fsdp.yaml's state dict type), as tests/support/fsdp_resume_check.py does for the VLM; from there everything
is accelerate's and the trainer's own: ``prepare`` shards the transformer in place, checkpoints gather its weights
(``get_state_dict``) into ``policy/``, and a resume loads them back after ``prepare``, into the sharded parameters.

Usage: flow_fsdp_resume_check.py OUT.json ROOT

For each of ``full`` (``model.lora_rank=0``) and ``lora``: a straight run (ROOT/<kind>-straight) trains 2 steps,
saving each; a second trainer (ROOT/<kind>-resumed) resumes from its step 1 and trains step 2. OUT.json (main
process), per kind: ``sharded`` (every parameter of both runs is a DTensor after ``prepare``), ``loaded_max_diff``
(max |resumed - saved| over every trainable weight right after loading step 1, the saved ones loaded unsharded into
a fresh adapter), ``rows`` (the straight and the resumed run's step-2 metrics), ``step2_max_diff`` (max |straight -
resumed| over the weights both save at step 2), ``step2_change`` (max |step 2 - step 1| over the resumed run's
saved weights: step 2 trained); for ``full`` also ``stock_max_diff`` (max |stock - saved| over the
step-1 ``transformer/`` folder loaded by the stock ``SD3Transformer2DModel.from_pretrained``, against the weights
the resumed run holds) and ``class_name`` (that folder's config ``_class_name``).
"""

import json
import sys
from pathlib import Path

import torch
from fsdp2 import fsdp2_trainer, write_report_and_exit
from random_flow import RANDOM_TINY_SD3
from safetensors.torch import load_file
from torch.distributed.tensor import DTensor

from mmgrpo.config import load_config
from mmgrpo.pipelines.flow.adapters import LORA_WEIGHT_NAME, load_adapter

out_path, root = sys.argv[1], Path(sys.argv[2])
KINDS = {"full": ["model.lora_rank=0"], "lora": ["model.lora_rank=4", "model.lora_alpha=8"]}
WEIGHTS = {"full": "transformer/diffusion_pytorch_model.safetensors", "lora": LORA_WEIGHT_NAME}


def config(run: str, kind: str, *overrides: str):
    return load_config("configs/flow/tiny_flowgrpo.yaml", [
        *RANDOM_TINY_SD3, f"output_dir={root / run}", *KINDS[kind], "train.max_steps=2", "train.save_every=1",
        "train.eval_every=0", "train.prompts_per_step=2", "train.group_size=2", "train.micro_batch_size=2",
        "sampling.num_steps=3", "optim.lr=1e-2", "num_threads=1", "logging.progress=false", "logging.plot_every=0",
        *overrides])




def whole(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def max_diff(first: dict[str, torch.Tensor], second: dict[str, torch.Tensor]) -> float:
    assert first.keys() == second.keys(), sorted(first.keys() ^ second.keys())[:3]
    return max((whole(first[k]).float() - whole(second[k]).float()).abs().max().item() for k in first)


def trainable(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach() for name, p in module.named_parameters() if p.requires_grad}


report = {}
for kind in KINDS:
    straight = fsdp2_trainer(config(f"{kind}-straight", kind))
    acc = straight.accelerator
    sharded = all(isinstance(p, DTensor) for p in straight.policy.model.parameters())
    rows = [straight.train()[-1:]]
    step1 = root / f"{kind}-straight" / "checkpoints" / "step-1"
    cfg = config(f"{kind}-resumed", kind, f"resume={step1}")
    resumed = fsdp2_trainer(cfg)
    sharded &= all(isinstance(p, DTensor) for p in resumed.policy.model.parameters())
    resumed.load_checkpoint(step1)
    saved = load_adapter(cfg.model)
    saved.load_trainable(step1 / "policy")  # unsharded
    held = trainable(resumed.policy.model)
    entry = {"sharded": sharded, "loaded_max_diff": max_diff(held, trainable(saved.transformer))}
    if kind == "full":
        from diffusers import SD3Transformer2DModel

        folder = step1 / "policy" / "transformer"
        stock = SD3Transformer2DModel.from_pretrained(folder)
        entry["stock_max_diff"] = max_diff(held, {k: v for k, v in stock.state_dict().items() if k in held})
        entry["class_name"] = json.loads((folder / "config.json").read_text())["_class_name"]
    rows.append(resumed.train()[-1:])  # loads step 1 again, as any resume does, and trains step 2
    entry["rows"] = rows
    if acc.is_main_process:
        first, second, before = (load_file(root / f"{kind}-{run}" / "checkpoints" / step / "policy" / WEIGHTS[kind])
                                 for run, step in (("straight", "step-2"), ("resumed", "step-2"), ("straight", "step-1")))
        entry["step2_max_diff"] = max_diff(first, second)
        entry["step2_change"] = max_diff(second, before)
    report[kind] = entry
    acc.wait_for_everyone()
write_report_and_exit(acc, report, out_path)
