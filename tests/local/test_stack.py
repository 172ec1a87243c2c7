"""Free ports for the local stack's services."""

from __future__ import annotations

import socket

from rollart.local.stack import free_port, free_ports


def test_ports_asked_for_together_are_distinct_and_bindable():
    ports = free_ports(64)
    assert len(set(ports)) == 64
    held = []
    try:
        for port in ports:  # each one is free right after: a service can bind it
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            held.append(sock)
            sock.bind(("127.0.0.1", port))
    finally:
        for sock in held:
            sock.close()


def test_a_free_port_is_none_of_those_already_handed_out():
    taken = set(free_ports(64))
    for _ in range(64):
        port = free_port(taken)
        assert port not in taken
        taken.add(port)
