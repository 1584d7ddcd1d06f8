import os
from pathlib import Path

import pytest

SUPPORT = Path(__file__).resolve().parent / "support"
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


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
