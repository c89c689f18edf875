"""A free TCP port on the loopback interface: where a head's local workers meet it, and where the
benchmarks and tests start servers. Stdlib only, so light callers import it without torch."""
from __future__ import annotations

import socket


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
