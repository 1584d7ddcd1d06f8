"""A free loopback TCP port, so tests that run side by side (pytest-xdist workers) never share a rendezvous: the
one ``mmgrpo demo`` launches its processes on."""

from mmgrpo.demo import free_port

__all__ = ["free_port"]
