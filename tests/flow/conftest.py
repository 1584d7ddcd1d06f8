"""Fixtures shared by the flow tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def tiny_cache(tmp_path_factory):
    """Tiny pipelines built once per test session into one cache folder (``MMGRPO_CACHE``), on one CPU thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MMGRPO_CACHE", str(tmp_path_factory.getbasetemp() / "mmgrpo-cache"))
        yield
    torch.set_num_threads(threads)
