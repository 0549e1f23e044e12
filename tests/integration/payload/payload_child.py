"""Child process for the fault tests: stage or capture a payload, with hooks to be killed mid-way.

Usage: payload_child.py stage STATE_ROOT DIGEST SIZE SOURCE [--step] [--die-before-record]
       payload_child.py capture STATE_ROOT OUT_DIR SEED [--step] [--die-before-record]

--step: after every progress report print "progress <done> <total>" and wait for a line on stdin
        (the parent decides when to SIGKILL us).
--die-before-record: SIGKILL ourselves right after the pack's rename, before its validation record.
--go-file PATH: wait until PATH exists before starting (two workers racing).
Prints one JSON result line at the end.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "unit" / "payload"))

from ansible_collections.coldsnap.fleet.plugins.module_utils.payload import writer as cache_mod


def main() -> None:
    args = sys.argv[1:]
    step = "--step" in args
    if "--die-before-record" in args:
        def die(*_a, **_k):
            os.kill(os.getpid(), signal.SIGKILL)

        cache_mod.write_settled_record = die
    if "--go-file" in args:
        go = Path(args[args.index("--go-file") + 1])
        while not go.exists():
            time.sleep(0.005)

    def progress(done: int, total: int) -> None:
        if step:
            print(f"progress {done} {total}", flush=True)
            sys.stdin.readline()

    if args[0] == "stage":
        from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.stage import (
            StageSource,
            stage_payload,
        )

        r = stage_payload(args[1], args[2], int(args[3]), StageSource("local", path=Path(args[4])), progress=progress)
        print(json.dumps(r.as_result()), flush=True)
    else:
        from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.cache import NodeCache
        from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.pack import (
            MemoryReader,
            write_worker_payload,
        )
        from payload_testlib import MODEL, make_worker

        out = Path(args[2])
        w = make_worker(out.parent / f"ckpt-{args[3]}", seed=int(args[3]))
        wp = write_worker_payload(out, w.allocations, w.extents, MemoryReader(w.buffers), export_pack=True,
                                  cache=NodeCache(args[1]), model=MODEL, progress=progress)
        print(json.dumps({"sha256": wp.pack.sha256, "size": wp.pack.size, "reused": wp.pack_reused}), flush=True)


if __name__ == "__main__":
    main()
