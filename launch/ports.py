"""A free TCP port on the loopback address, for the servers the preflight, the demo, the benchmarks and the tests start."""

import socket


def free_port() -> int:
    """A port on 127.0.0.1 that nothing listens on right now (the OS picks it from its ephemeral range)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
