"""``coldsnap payload verify|inspect|build``: the model-payload tools for users and tests.

``verify`` runs the same verifier as the ``payload_verify`` module and the
in-unit runtime; ``inspect`` summarizes a pack, manifest, replay plan or
validation record without hashing (``--hash`` verifies read-only);
``build`` writes pack + residual + manifest + replay plan from a JSON
description of allocations and extents plus raw allocation byte files.
"""

from __future__ import annotations

import os
import stat
import sys
import time
from pathlib import Path

from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import ColdSnapError
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats import identifiers as ids
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.schema import (
    Arr,
    Field,
    Int,
    Obj,
    Str,
    validate_document,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.strictjson import strict_loads
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.versions import (
    NATIVE_MANIFEST_KIND,
    REPLAY_PLAN_KIND,
    VALIDATION_RECORD_KIND,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.cache import NodeCache
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.layout import (
    Allocation,
    ModelExtent,
    TensorSource,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.manifest import (
    ALLOCATION,
    MODEL,
    SOURCE,
    load_manifest,
    load_replay_plan,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.verifier import PayloadVerifier

from coldsnap.commands._io import print_json, read_input

BUILD_SCHEMA = Obj({
    "model": Field(MODEL),
    "allocations": Field(Arr(Obj({
        **ALLOCATION.fields,
        "bytes": Field(Str(min_len=1, description="raw allocation bytes file (relative to the description)")),
    }), min_items=1)),
    "extents": Field(Arr(Obj({
        "allocation": Field(Str(min_len=1)),
        "offset": Field(Int(minimum=0)),
        "size": Field(Int(minimum=1)),
        "source": Field(SOURCE),
    }))),
})


class TtyProgress:
    """A one-line progress display on stderr when it is a terminal; silent otherwise."""

    def __init__(self, label: str, stream=None) -> None:
        self.label = label
        self.stream = stream or sys.stderr
        self.enabled = self.stream.isatty()
        self.started = time.monotonic()
        self.last = 0.0
        self.shown = False

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if done < total and now - self.last < 0.1:
            return
        self.last = now
        pct = 100.0 * done / total if total else 100.0
        rate = done / max(now - self.started, 1e-9) / 1e9
        self.stream.write(f"\r{self.label} {pct:5.1f}%  {done / 1e9:.2f}/{total / 1e9:.2f} GB  {rate:.2f} GB/s ")
        self.stream.flush()
        self.shown = True

    def finish(self) -> None:
        if self.shown:
            self.stream.write("\n")
            self.stream.flush()


def register(sub) -> None:
    p = sub.add_parser("payload", help="verify, inspect and build model payloads (model-weights.pack)")
    psub = p.add_subparsers(dest="payload_command", metavar="ACTION", required=True)

    v = psub.add_parser("verify", help="verify packs (size, validation record or full SHA-256)",
                        description="Verify one pack, or several at once (repeat --sha256 and --size, and "
                                    "--path when given, in the same order); files are hashed in parallel.")
    v.add_argument("--sha256", required=True, action="append", help="payload digest 'sha256:<64 hex>' (repeatable)")
    v.add_argument("--size", required=True, action="append", type=int, help="payload size in bytes (repeatable)")
    where = v.add_mutually_exclusive_group(required=True)
    where.add_argument("--state-root", help="state root holding model-payloads/sha256/")
    where.add_argument("--path", action="append",
                       help="explicit pack path (must end in model-payloads/sha256/<hex>.pack; repeatable)")
    v.add_argument("--no-record", action="store_true",
                   help="read-only: do not write a validation record, lock or quarantine")
    v.add_argument("--jobs", type=int, default=None,
                   help="packs hashed at once (default: the CPUs this process may use)")
    v.set_defaults(func=run_verify)

    i = psub.add_parser("inspect", help="summarize a pack, native manifest, replay plan or validation record")
    i.add_argument("path", help="a .pack file or a JSON document")
    i.add_argument("--hash", action="store_true", help="for a pack: also hash it (read-only verification)")
    i.set_defaults(func=run_inspect)

    b = psub.add_parser("build", help="build pack + residual + manifest + replay plan from a JSON description")
    b.add_argument("--description", required=True, metavar="PATH|-",
                   help="JSON {model, allocations[{id,address,size,bytes}], extents[{allocation,offset,size,source}]}")
    b.add_argument("--out", required=True, help="directory for weights.blob, native-manifest.json, replay-plan.json")
    b.add_argument("--state-root", help="node cache that receives the pack (omit with --no-pack)")
    b.add_argument("--no-pack", action="store_true", help="do not export the pack")
    b.add_argument("--safetensors-dir", help="check sources against (and pin) these checkpoint files")
    b.set_defaults(func=run_build)


def run_verify(args) -> int:
    for digest in args.sha256:
        ids.parse_digest(digest, what="--sha256")  # refused before any path is built
    if len(args.size) != len(args.sha256) or (args.path and len(args.path) != len(args.sha256)):
        raise ColdSnapError(f"{len(args.sha256)} --sha256, {len(args.size)} --size and "
                            f"{len(args.path or [])} --path given", fix="give one --size (and one --path "
                            "unless --state-root is used) per --sha256, in the same order")
    if args.jobs is not None and args.jobs < 1:
        raise ColdSnapError(f"--jobs {args.jobs} is not a positive number", fix="give 1 or more, or omit --jobs")
    if not args.path:
        from coldsnap.api import resolve_state_root  # empty, a file, unreadable: refused by name

        args.state_root = resolve_state_root(args.state_root)
    targets = [Path(p) for p in args.path] if args.path else [NodeCache(args.state_root)] * len(args.sha256)
    label = args.sha256[0][:19] if len(args.sha256) == 1 else f"{len(args.sha256)} packs"
    progress = TtyProgress(f"verifying {label}…")
    started = time.monotonic()
    try:
        if len(args.sha256) == 1:
            with PayloadVerifier().verify(targets[0], args.sha256[0], args.size[0],
                                          write_record=not args.no_record, progress=progress) as v:
                result = v.as_result()
                result["seconds"] = round(v.seconds, 3)
        else:
            verified = PayloadVerifier().verify_many(list(zip(targets, args.sha256, args.size, strict=True)),
                                                     jobs=args.jobs, write_record=not args.no_record,
                                                     progress=progress)
            payloads = []
            for v in verified:
                with v:
                    payloads.append({**v.as_result(), "seconds": round(v.seconds, 3)})
            result = {"verified": True, "payloads": payloads,
                      "bytes_hashed": sum(p["bytes_hashed"] for p in payloads),
                      "seconds": round(time.monotonic() - started, 3)}
    finally:
        progress.finish()
    print_json(result)
    return 0


def _inspect_pack(path: Path, do_hash: bool) -> dict:
    name = path.name
    hexd = name[: -len(".pack")] if name.endswith(".pack") else ""
    digest = f"sha256:{hexd}"
    ids.parse_digest(digest, what=f"digest in the file name {name!r}")
    try:
        st = path.lstat()
    except (FileNotFoundError, NotADirectoryError):
        raise ColdSnapError(f"{path} does not exist",
                            fix="give the path of a pack (<state root>/model-payloads/sha256/<hex>.pack)") from None
    except PermissionError:
        raise ColdSnapError(f"{path}: permission denied (this user may not look into its directories)",
                            fix="run as the state root's owner (or root)") from None
    if stat.S_ISLNK(st.st_mode):
        raise ColdSnapError(f"{path} is a symbolic link (to {os.readlink(path)!r}); packs are regular files and a "
                            "link is refused, never followed",
                            fix="give the path of the pack itself (<state root>/model-payloads/sha256/<hex>.pack)")
    if not stat.S_ISREG(st.st_mode):
        raise ColdSnapError(f"{path} is not a regular file; a pack is one",
                            fix="give the path of a pack (<state root>/model-payloads/sha256/<hex>.pack)")
    size = st.st_size
    verifier = PayloadVerifier()
    check = verifier.inspect(path, digest, size)
    out = {"kind": "model-payload", "path": str(path), "sha256": digest, "size": size,
           "pages": size // 4096, "aligned": size % 4096 == 0,
           "record": {"status": check.status, "reason": check.reason}}
    if do_hash:
        progress = TtyProgress(f"hashing {digest[:19]}…")
        try:
            with verifier.verify(path, digest, size, write_record=False, progress=progress, rehash=True) as v:
                out["verified"] = True
                out["bytes_hashed"] = v.bytes_hashed
        finally:
            progress.finish()
    return out


def run_inspect(args) -> int:
    path = Path(args.path)
    if path.suffix == ".pack":
        print_json(_inspect_pack(path, args.hash))
        return 0
    data = read_input(args.path)
    doc = strict_loads(data, document=str(path))
    kind = doc.get("kind") if isinstance(doc, dict) else None
    if kind == NATIVE_MANIFEST_KIND:
        print_json(load_manifest(data).summary())
    elif kind == REPLAY_PLAN_KIND:
        print_json(load_replay_plan(data).summary())
    elif kind == VALIDATION_RECORD_KIND:
        from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.records import RECORD_SCHEMA

        print_json(validate_document(RECORD_SCHEMA, doc, document=str(path)))
    else:
        raise ColdSnapError(f"{path} is not a pack, native manifest, replay plan or validation record (kind {kind!r})",
                            fix="give a .pack file or one of those JSON documents")
    return 0


def _check_bytes_file(alloc: Allocation, p: Path) -> None:
    """An allocation's bytes file is a regular file holding at least the whole allocation."""
    what = f"allocation {alloc.id!r}: bytes file {p}"
    try:
        st = p.stat()
    except (FileNotFoundError, NotADirectoryError):
        raise ColdSnapError(f"{what} does not exist", fix="dump the whole allocation into that file") from None
    except OSError as exc:
        raise ColdSnapError(f"{what} cannot be looked at ({exc.strerror})",
                            fix="give a file this user can read") from None
    if not stat.S_ISREG(st.st_mode):
        kind = "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file"
        raise ColdSnapError(f"{what} is {kind}; the allocation's raw bytes must be a regular file",
                            fix="give the file the allocation was dumped into")
    if st.st_size < alloc.size:
        raise ColdSnapError(f"{what} holds {st.st_size} bytes, shorter than the allocation's {alloc.size}",
                            fix="dump the whole allocation into that file")


def run_build(args) -> int:
    from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.pack import (
        FileAllocationReader,
        write_worker_payload,
    )

    if not args.no_pack and not args.state_root:
        raise ColdSnapError("build needs --state-root for the pack", fix="give --state-root DIR or --no-pack")
    base = Path(args.description).parent if args.description != "-" else Path.cwd()
    name = f"build description {args.description}"
    doc = validate_document(BUILD_SCHEMA, strict_loads(read_input(args.description), document=name), document=name)
    allocs = [Allocation(a["id"], a["address"], a["size"]) for a in doc["allocations"]]
    files = {a["id"]: (base / a["bytes"]) for a in doc["allocations"]}
    for a in allocs:
        _check_bytes_file(a, files[a.id])
    extents = []
    for e in doc["extents"]:
        s = e["source"]
        extents.append(ModelExtent(e["allocation"], e["offset"], e["size"], TensorSource(
            s["file"], s["tensor"], s["dtype"], tuple(s["shape"]), tuple(s["slice"]) if s["slice"] else None)))
    reader = FileAllocationReader(files)
    progress = TtyProgress("building payload")
    try:
        wp = write_worker_payload(Path(args.out), allocs, extents, reader, export_pack=not args.no_pack,
                                  cache=NodeCache(args.state_root) if args.state_root else None, model=doc["model"],
                                  progress=progress,
                                  safetensors_dir=Path(args.safetensors_dir) if args.safetensors_dir else None)
    finally:
        progress.finish()
        reader.close()
    out = {"pack": wp.pack.as_dict() if wp.pack else None, "pack_reused": wp.pack_reused,
           "residual": wp.residual.as_dict(), "manifest": wp.manifest.as_dict(), "replay": wp.replay.as_dict(),
           "allocations": wp.allocations, "model_extents": wp.model_extents, "model_bytes": wp.model_bytes,
           "residual_bytes": wp.residual_bytes, "pack_size": wp.pack_size}
    print_json(out)
    return 0
