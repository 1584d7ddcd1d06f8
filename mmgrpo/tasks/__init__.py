"""Synthetic tasks generated deterministically by code, each with a held-out split (registry ``TASKS``)."""
