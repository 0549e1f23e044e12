"""``coldsnap capabilities``."""

from __future__ import annotations

from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.capabilities import capabilities

from coldsnap.commands._io import print_json


def register(sub) -> None:
    p = sub.add_parser("capabilities", help="print supported operations, formats, engines and drivers as JSON")
    p.set_defaults(func=run)


def run(args) -> int:
    print_json(capabilities())
    return 0
