"""``python -m coldsnap_activation {capture,capture-running,restore,warm,sleep,wake,status,finish-warm} --spec FILE``."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.unit import UNIT_OPERATIONS


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # Everything the runtime (and CRIU, its child) writes is private: images hold process memory.
    os.umask(0o077)
    if argv[:1] == ["keeper"]:
        k = argparse.ArgumentParser(prog="coldsnap_activation keeper",
                                    description="restore a process tree and parent it; what to restore comes "
                                                "as one JSON line on stdin")
        k.add_argument("--criu", default=None)
        ka = k.parse_args(argv[1:])
        from coldsnap_activation.keeper import run

        return run(ka.criu)
    p = argparse.ArgumentParser(prog="coldsnap_activation")
    p.add_argument("operation", choices=UNIT_OPERATIONS)
    p.add_argument("--spec", required=True, type=Path, help="unit spec JSON written by the module")
    p.add_argument("--evidence", type=Path, default=None, help="write evidence JSON here (default stdout)")
    args = p.parse_args(argv)
    from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.unit import UnitSpec

    spec = UnitSpec.load(args.spec)
    if spec.operation != args.operation:
        print(f"spec is for {spec.operation!r}, not {args.operation!r}", file=sys.stderr)
        return 2
    from coldsnap_activation import keeper

    # A restore's keepers start now: their start-up overlaps ours (the imports below, admission).
    keepers = keeper.prestart(spec)
    from coldsnap_activation.sequence import main_run

    return main_run(spec, args.evidence, keepers=keepers)


if __name__ == "__main__":
    sys.exit(main())
