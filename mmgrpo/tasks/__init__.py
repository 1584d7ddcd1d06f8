"""Synthetic tasks generated deterministically by code, each with a held-out split (registry ``TASKS``)."""

from . import shapes, shapes_qa  # noqa: F401  (they register shapes_t2i; shapes_qa and motion_qa)
