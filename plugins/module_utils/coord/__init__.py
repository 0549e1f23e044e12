"""CSKV v1: the activation-scoped coordinator (protocol, server, client, barrier, endpoint, daemon).

Private to this collection; see docs/coordinator.md for the wire format and behaviour.
"""
