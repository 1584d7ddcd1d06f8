"""A free loopback TCP port, so tests that run side by side (pytest-xdist workers) never share a rendezvous."""

import socket


def free_port() -> int:
    """A port on 127.0.0.1 that nothing listens on now (the OS picks it; the caller binds it soon after)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
