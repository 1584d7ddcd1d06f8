"""Synthetic tasks generated deterministically by code, each with a held-out split (registry ``TASKS``)."""

from . import shapes  # noqa: F401  (registers shapes_t2i)
from . import shapes_qa  # noqa: F401  (registers shapes_qa, motion_qa)
