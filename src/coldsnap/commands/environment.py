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

    if args.python is not None and not args.python.strip():
        # an unset shell variable (--python "$PY") must not mean this interpreter, the controller's own
        from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import ColdSnapError

        raise ColdSnapError("--python is empty",
                            fix="give the unit environment's interpreter, or leave the option out for this one")
    if args.python:
        import os

        python = os.path.abspath(args.python) if "/" in args.python else args.python  # it runs from /
        out = environment.of_python(python, describe_it=args.describe)
        print(json.dumps(json.loads(out), indent=2) if args.describe else out)
    else:
        print(json.dumps(environment.describe(), indent=2) if args.describe else environment.compute())
    return 0
