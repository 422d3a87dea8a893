"""Test-wide guards: the tests must pass with networking off, so any attempt to open a
non-local connection fails loudly instead of silently downloading something."""

import socket

import pytest

_LOCAL = ("127.0.0.1", "::1", "localhost")


@pytest.fixture(autouse=True)
def _no_network(monkeypatch):
    real_connect = socket.socket.connect

    def guarded_connect(self, address):
        host = address[0] if isinstance(address, tuple) else address
        if isinstance(host, str) and host not in _LOCAL and not host.startswith("/"):
            raise RuntimeError(f"test tried to reach the network ({address}); tests must run offline")
        return real_connect(self, address)

    monkeypatch.setattr(socket.socket, "connect", guarded_connect)
    yield
