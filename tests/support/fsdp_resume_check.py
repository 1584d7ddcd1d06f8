"""Run under ``accelerate launch`` with two gloo processes (configs/accelerate/cpu_2proc.yaml): resuming a full
fine-tune of the shipped tiny Qwen2-VL whose weights accelerate's FSDP2 shards. accelerate turns FSDP on for GPU
launches only (``Accelerator(cpu=True)`` keeps a MULTI_CPU run), so this sets its distributed type to FSDP with an
FSDP2 plugin as configs/accelerate/fsdp.yaml configures it (TRANSFORMER_BASED_WRAP, resharding after forward,
and fsdp.yaml's state dict type); from there everything is accelerate's own: ``prepare`` shards the model in place
(``fsdp2_prepare_model``), checkpoints gather the weights (``get_state_dict``) and ``save_state`` / ``load_state``
write and read the optimiser and accelerate's own copy of the model, and the trainer loads the weights after ``prepare``, into the sharded parameters.

Usage: fsdp_resume_check.py OUT.json ROOT

A straight run (ROOT/straight) trains 2 steps, saving each; a second trainer (ROOT/resumed) resumes from its step 1
and trains step 2. OUT.json (main process): ``sharded`` (every parameter of both runs is a DTensor after
``prepare``), ``loaded_max_diff`` (max |resumed - saved| over every weight right after loading step 1, the saved
ones loaded unsharded from its policy folder), ``rows`` (the straight and the resumed run's step-2 metrics) and
``step2_max_diff`` (max |straight - resumed| over the weights both save at step 2) and ``checkpoint`` (the names in
the straight run's step-2 checkpoint).
"""

import sys
from pathlib import Path

from fsdp2 import fsdp2_trainer, write_report_and_exit
from safetensors.torch import load_file
from torch.distributed.tensor import DTensor

from mmgrpo.config import load_config
from mmgrpo.pipelines.vlm.model import VLMModel

out_path, root = sys.argv[1], Path(sys.argv[2])


def config(run: str, *overrides: str):
    return load_config("configs/vlm/tiny_image.yaml", [
        f"output_dir={root / run}", "model.lora_rank=0", "train.max_steps=2", "train.save_every=1",
        "train.eval_every=0", "train.prompts_per_step=2", "train.group_size=4", "train.micro_batch_size=4",
        "logging.progress=false", "logging.plot_every=0", *overrides])




straight = fsdp2_trainer(config("straight"))
acc = straight.accelerator
sharded = all(isinstance(p, DTensor) for p in straight.policy.model.parameters())
rows = [straight.train()[-1:]]
step1 = root / "straight" / "checkpoints" / "step-1"
cfg = config("resumed", f"resume={step1}")
resumed = fsdp2_trainer(cfg)
sharded &= all(isinstance(p, DTensor) for p in resumed.policy.model.parameters())
resumed.load_checkpoint(step1)
saved = VLMModel(cfg.model)
saved.load(step1 / "policy")  # unsharded
expected = dict(saved.model.named_parameters())
loaded_max_diff = max((p.full_tensor() - expected[name]).abs().max().item()
                      for name, p in resumed.policy.model.named_parameters())
rows.append(resumed.train()[-1:])  # loads step 1 again, as any resume does, and trains step 2
report = {}
if acc.is_main_process:
    first, second = (load_file(root / run / "checkpoints" / "step-2" / "policy" / "model.safetensors")
                     for run in ("straight", "resumed"))
    report = {"sharded": sharded, "loaded_max_diff": loaded_max_diff, "rows": rows,
              "step2_max_diff": max((first[k] - second[k]).abs().max().item() for k in first),
              "checkpoint": sorted(f.name for f in (root / "straight" / "checkpoints" / "step-2").iterdir())}
write_report_and_exit(acc, report, out_path)
