"""Ports for test engines: free now, and outside the kernel's ephemeral range, so that no outgoing
connection of another process can take a captured listener's port before the restore binds it again
(a port handed out by ``bind(0)`` is an ephemeral one)."""

from __future__ import annotations

import socket

from ansible_collections.coldsnap.fleet.plugins.module_utils.common.listen_ports import restorable_ports


def free_port(host: str = "127.0.0.1") -> int:
    for candidate in restorable_ports(256):
        with socket.socket() as s:
            try:
                s.bind((host, candidate))
            except OSError:
                continue
            return candidate
    raise RuntimeError("no free port outside the ephemeral range")
