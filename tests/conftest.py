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
