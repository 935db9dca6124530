"""A port of 127.0.0.1 for a test's launch that no other process is given meanwhile.

A port found free by binding port 0 and closing the socket stays free only by luck: the
launched processes bind it seconds later (after importing torch), and until then the
kernel may hand it to anyone asking for an ephemeral port, such as the gloo connections of
tests running alongside; the run's store then fails to bind ("address already in use").
Held bound, not listening, with SO_REUSEADDR, the port is given to no one else, while
c10d's store (which sets SO_REUSEADDR too) can still bind and listen on it.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator

__all__ = ["reserved_port"]


@contextlib.contextmanager
def reserved_port() -> Iterator[int]:
    """A free port, kept from other processes until the block ends."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        yield int(sock.getsockname()[1])
