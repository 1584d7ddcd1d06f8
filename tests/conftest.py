import os
from pathlib import Path

import pytest
from ports import free_port

SUPPORT = Path(__file__).resolve().parent / "support"
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # the workers share the cores: one intra-op thread each (and in their subprocesses), set before torch loads
    os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture
def support_env():
    """Environment for subprocesses that must import the test-support modules (the toy pipeline)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(SUPPORT), env.get("PYTHONPATH", "")] if p)
    return env


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module (``pytestmark = pytest.mark.usefixtures("one_thread")``): the tiny models'
    calls are too small to gain from a second thread, and on the shared 2-core machine two threads stall on each
    other (about 10x slower)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def launch_two_processes(support_env, tmp_path):
    """``launch_two_processes(script, *args, launcher="cpu_2proc") -> dict``: runs ``tests/support/<script>
    OUT.json *args`` under ``accelerate launch`` with two gloo processes on a free rendezvous port, and returns the
    JSON report the script writes to OUT.json. ``launcher`` names the config in configs/accelerate/ (cpu_2proc:
    DDP); one for GPUs is launched with two processes and without mixed precision."""
    import json
    import shutil
    import subprocess

    if shutil.which("accelerate") is None:
        pytest.skip("the accelerate launcher is not on PATH")
    env = {**support_env, "OMP_NUM_THREADS": "1"}

    def run(script, *args, launcher="cpu_2proc"):
        out = tmp_path / f"{Path(script).stem}-{launcher}.json"
        config = SUPPORT.parent.parent / "configs" / "accelerate" / f"{launcher}.yaml"
        on_cpu = [] if launcher == "cpu_2proc" else ["--num_processes", "2", "--mixed_precision", "no"]
        cmd = ["accelerate", "launch", "--config_file", str(config), *on_cpu, "--main_process_port", str(free_port()),
               str(SUPPORT / script), str(out), *map(str, args)]
        proc = subprocess.run(cmd, env=env, cwd=SUPPORT.parent.parent, capture_output=True, text=True, timeout=300,
                              check=False)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(out.read_text())

    return run


@pytest.fixture
def train_on_two_processes(launch_two_processes, tmp_path):
    """``train_on_two_processes(config, *overrides) -> dict``: trains ``config`` with two gloo DDP processes through
    tests/support/pipeline_ddp_check.py, and returns its report (num_processes, param_rank_diff, param_change,
    onpolicy_max_dev)."""

    def run(config, *overrides):
        return launch_two_processes("pipeline_ddp_check.py", config, f"output_dir={tmp_path / 'run'}",
                                    "logging.progress=false", "logging.plot_every=0", "train.eval_every=0",
                                    "train.save_every=0", *overrides)

    return run


@pytest.fixture
def one_process_group():
    """A one-process gloo group for a test (FSDP2's ``fully_shard`` needs one); skipped if one is already up."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this test process")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()
