"""``free_port()``: a TCP port on 127.0.0.1 that nothing listens on, for a gloo rendezvous.

The one copy: distributed/_harness.py's ``spawn`` and the tests that run a rank in a subprocess (a README
torchrun block) or in-process (a one-rank group) all take their port from here. The port is free when
asked and bound moments later by the rendezvous.
"""

import socket


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
