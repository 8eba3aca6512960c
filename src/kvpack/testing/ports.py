"""Loopback ports for tests that must name a port before the service that binds it starts.

Binding port 0 and closing the socket hands back a port from the kernel's ephemeral range,
and until the service binds it any outgoing connection on the host may take that very port
as its source port: a rare failure that comes and goes with the load. The ports handed out
here lie *below* the ephemeral range (``net.ipv4.ip_local_port_range``), where only an
explicit bind can take them, and each is handed out at most once per process. Where the
range leaves no room below it, port 0 is the fallback.
"""

from __future__ import annotations

import random
import socket
import threading

#: Lowest port handed out (above the registered services most hosts run).
FLOOR = 10000

_lock = threading.Lock()
_given: set[int] = set()
_rng = random.Random()


def ephemeral_low(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> int:
    """First port of the kernel's ephemeral range (32768 where it cannot be read)."""
    try:
        with open(path) as fh:
            return int(fh.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _port_zero(host: str) -> int:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def free_port(host: str = "127.0.0.1") -> int:
    """A port on ``host`` that nothing holds now, outside the ephemeral range."""
    top = ephemeral_low()
    if top - FLOOR < 1000:
        return _port_zero(host)
    with _lock:
        for _ in range(500):
            port = _rng.randrange(FLOOR, top)
            if port not in _given and _bindable(host, port):
                _given.add(port)
                return port
    return _port_zero(host)


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct ports, as :func:`free_port`."""
    return [free_port(host) for _ in range(n)]
