"""Ports the local stack hands its services: free, distinct, and outside the kernel's ephemeral range
(from which outgoing connections take their source ports, so a port chosen there can be taken by a
client's connection before its service binds it)."""

from __future__ import annotations

import socket

from rollart.local.stack import LISTEN_PORTS_FROM, _ephemeral_ports, free_port, free_ports


def test_free_ports_are_distinct_bindable_and_below_the_ephemeral_range():
    low, _ = _ephemeral_ports()
    ports = free_ports(8)
    assert len(set(ports)) == 8
    assert all(LISTEN_PORTS_FROM <= port < low for port in ports)
    for port in ports:  # nothing holds them once handed out
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", port))


def test_a_port_handed_out_before_is_not_handed_out_again():
    taken = set(free_ports(3))
    assert free_port(taken=taken) not in taken
