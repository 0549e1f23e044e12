"""``coldsnap environment-digest``: the digest a runtime-host unit pins (``environment_digest``)."""

from __future__ import annotations

from ansible_collections.coldsnap.fleet.plugins.module_utils.units import environment


def register(sub) -> None:
    p = sub.add_parser("environment-digest",
                       help="print the environment digest of a Python environment (runtime 'host' units pin it)")
    p.add_argument("--python", default=None, help="interpreter of the unit environment (default: this one)")
    p.add_argument("--describe", action="store_true", help="print what the digest covers instead")
    p.set_defaults(func=run)


def run(args) -> int:
    import json

    if args.describe:
        print(json.dumps(environment.describe(), indent=2))
    else:
        print(environment.of_python(args.python) if args.python else environment.compute())
    return 0
