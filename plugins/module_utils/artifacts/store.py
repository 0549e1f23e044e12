"""Local descriptor storage: one lineage per identity, atomic promotion, retention of N generations.

Layout, on the control node under the state root::

    artifacts/<identity hex>/
        .lock                    flock: one writer of this identity at a time
        identity.json            what the identity stands for (recipe, snapshot driver, engine, model, runtime)
        000001/                  a generation: complete before its name appears, never edited after
            artifact.json        the committed descriptor, byte for byte
            generation.json      number, capture id, descriptor digest, where it was committed from
        000002/
        current -> 000002        symbolic link, replaced with rename(2)
        overlays/<portable hex>/<binding hex>/    target-local overlays (see :mod:`.overlay`)

``<identity hex>`` is the hex of the request's :func:`~..formats.request.identity`
(recipe, model, engine, runtime, topology and snapshot driver), so a restore
request can name ``artifacts/<identity hex>/current/artifact.json``.

Promotion writes a generation under a temporary name, fsyncs it and renames it
into place; then it writes the new pointer as a temporary symlink and renames it
over ``current``. rename(2) is atomic, so a reader, or a promotion killed at any
instruction, sees the old pointer or the new one and never a half-written one.
What a killed promotion leaves behind has a temporary name; the next writer
removes it (it holds the identity lock, so no live writer can own it).

Retention keeps the newest N generations and always the current one. A pruned
generation's descriptor goes; what it alone referenced on the hosts (capture
directory, capsules, capture-local payloads) is removed by
:func:`.cleanup.remove_local`, which never removes a payload that any retained
generation of any identity still references.

Why one ~560-line unit: every operation on a lineage (promote, prune, delete, list)
holds the identity lock and relies on the same crash-safety argument above; splitting
them would spread that argument over several files.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import os
import re
import shutil
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from ansible_collections.coldsnap.fleet.plugins.module_utils.artifacts import overlay as overlay_mod
from ansible_collections.coldsnap.fleet.plugins.module_utils.artifacts.refs import local_refs
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import ColdSnapError
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.fsutil import (
    atomic_write_json,
    file_lock,
    file_sha256,
    fsync_dir,
    is_temp_name,
    rmtree_atomically,
    temp_path_for,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.state_layout import StateLayout
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.identifiers import parse_digest
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.versions import (
    ARTIFACT_STORE_FORMAT,
    STORE_GENERATION_KIND,
    STORE_IDENTITY_KIND,
)

STORE_DIR = "artifacts"
CURRENT = "current"
LOCK = ".lock"
IDENTITY_FILE = "identity.json"
GENERATION_FILE = "generation.json"
ARTIFACT_FILE = "artifact.json"
OVERLAYS = "overlays"
IDENTITY_KIND = STORE_IDENTITY_KIND
GENERATION_KIND = STORE_GENERATION_KIND
STORE_FORMAT = ARTIFACT_STORE_FORMAT
GENERATION_RE = re.compile(r"[0-9]{6,}\Z")
HEX_RE = re.compile(r"[0-9a-f]{64}\Z")
LOCK_TIMEOUT = 600.0

Hook = Callable[[str], None]


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _hex(identity: str) -> str:
    """``sha256:<hex>`` or ``<hex>`` -> ``<hex>`` (validated before it becomes a path)."""
    if HEX_RE.match(identity or ""):
        return identity
    return parse_digest(identity, what="artifact identity")


@dataclass(frozen=True)
class IdentityInfo:
    """What one identity directory stands for (``identity.json``)."""

    identity: str  # hex
    recipe: str
    snapshot_driver: str
    engine: str
    model: dict
    runtime: str

    def as_dict(self) -> dict:
        return {"identity": f"sha256:{self.identity}", "recipe": self.recipe, "snapshot_driver": self.snapshot_driver,
                "engine": self.engine, "model": self.model, "runtime": self.runtime}


@dataclass(frozen=True)
class Generation:
    """One stored generation of an identity."""

    identity: str  # hex
    number: int
    path: Path
    capture_id: str
    artifact_sha256: str
    source: str | None
    promoted_at: str

    @property
    def name(self) -> str:
        return f"{self.number:06d}"

    @property
    def artifact_path(self) -> Path:
        return self.path / ARTIFACT_FILE

    def load(self) -> dict:
        """The stored descriptor, validated."""
        from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.artifact import load_artifact

        return load_artifact(self.artifact_path.read_bytes(), document=str(self.artifact_path))

    def as_dict(self) -> dict:
        return {"identity": f"sha256:{self.identity}", "generation": self.name, "number": self.number,
                "path": str(self.artifact_path), "capture_id": self.capture_id,
                "artifact_sha256": self.artifact_sha256, "source": self.source, "promoted_at": self.promoted_at}


@dataclass
class PromoteResult:
    """What :meth:`ArtifactStore.promote` did (or would do in check mode)."""

    changed: bool
    generation: dict
    current: str
    created: bool
    pruned: list[dict] = field(default_factory=list)
    cleanup: list[dict] = field(default_factory=list)
    keep_payloads: list[str] = field(default_factory=list)
    cleanup_hosts: list[str] = field(default_factory=list)
    keep_capsules: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"changed": self.changed, "generation": self.generation, "current": self.current,
                "created": self.created, "pruned": self.pruned, "cleanup": self.cleanup,
                "keep_payloads": self.keep_payloads, "keep_capsules": self.keep_capsules,
                "cleanup_hosts": self.cleanup_hosts}


@dataclass
class DeleteResult:
    """What :meth:`ArtifactStore.delete` removed (or would remove)."""

    changed: bool
    identities: list[dict] = field(default_factory=list)
    removed: list[dict] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)
    cleanup: list[dict] = field(default_factory=list)
    keep_payloads: list[str] = field(default_factory=list)
    cleanup_hosts: list[str] = field(default_factory=list)
    keep_capsules: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"changed": self.changed, "identities": self.identities, "removed": self.removed,
                "sources": self.sources, "cleanup": self.cleanup, "keep_payloads": self.keep_payloads,
                "keep_capsules": self.keep_capsules, "cleanup_hosts": self.cleanup_hosts}


def identity_info_of(request: dict) -> IdentityInfo:
    """The identity of ``request`` and what it stands for."""
    from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.request import identity

    launch = request["launch"]
    return IdentityInfo(identity=_hex(identity(request)), recipe=request["workload"]["recipe"],
                        snapshot_driver=request["snapshot_driver"]["id"], engine=launch["engine"],
                        model={"id": launch["model"]["id"], "revision": launch["model"]["revision"]},
                        runtime=launch["runtime"])


class ArtifactStore:
    """The descriptor store under ``<state_root>/artifacts``."""

    def __init__(self, state_root: Path | str) -> None:
        self.state_root = StateLayout(state_root).root  # refuses an empty or relative state root
        self.root = self.state_root / STORE_DIR

    def __repr__(self) -> str:
        return f"ArtifactStore({str(self.state_root)!r})"

    # ----------------------------------------------------------------- paths
    def identity_dir(self, identity: str) -> Path:
        return self.root / _hex(identity)

    def current_link(self, identity: str) -> Path:
        return self.identity_dir(identity) / CURRENT

    def current_artifact_path(self, identity: str) -> Path:
        """``artifacts/<identity hex>/current/artifact.json`` (what a restore request may name)."""
        return self.current_link(identity) / ARTIFACT_FILE

    def overlay_root(self, identity: str, portable_sha256: str) -> Path:
        """Where the overlays of one portable descriptor live."""
        return self.identity_dir(identity) / OVERLAYS / parse_digest(portable_sha256, what="portable descriptor digest")

    @contextlib.contextmanager
    def locked(self, identity: str, *, timeout: float | None = LOCK_TIMEOUT):
        """Hold the identity's writer lock for the block."""
        idir = self.identity_dir(identity)
        for _attempt in range(20):
            idir.mkdir(parents=True, exist_ok=True, mode=0o700)
            try:
                with file_lock(idir / LOCK, timeout=timeout) as fd:
                    # A delete that held the lock before us moved this directory away (its lock file with
                    # it): the lock we hold is on that one, so take the new directory's instead.
                    try:
                        same = os.path.samestat(os.fstat(fd), os.stat(idir / LOCK))
                    except FileNotFoundError:
                        same = False
                    if same:
                        yield idir
                        return
            except TimeoutError as exc:
                raise ColdSnapError(f"artifact identity {idir.name}: {exc}",
                                    fix="another promotion or delete of this identity is running; wait for it") from None
        raise ColdSnapError(f"artifact identity {idir.name}: its directory kept being replaced while waiting for it",
                            fix="run the operation again once the deletes of this identity are done")

    # ----------------------------------------------------------------- reads
    def identities(self) -> list[IdentityInfo]:
        """Every identity with stored metadata (other directories under ``artifacts/`` are ignored)."""
        out = []
        if not self.root.is_dir():
            return out
        for entry in sorted(os.scandir(self.root), key=lambda e: e.name):
            if entry.is_dir(follow_symlinks=False) and HEX_RE.match(entry.name):
                info = self.info(entry.name)
                if info is not None:
                    out.append(info)
        return out

    def info(self, identity: str) -> IdentityInfo | None:
        """``identity.json`` of an identity, or None when it has none (or it is unreadable)."""
        path = self.identity_dir(identity) / IDENTITY_FILE
        try:
            doc = json.loads(path.read_text())
            if not isinstance(doc, dict) or doc.get("kind") != IDENTITY_KIND or doc.get("identity") != f"sha256:{_hex(identity)}":
                return None
            return IdentityInfo(identity=_hex(identity), recipe=doc["recipe"], snapshot_driver=doc["snapshot_driver"],
                                engine=doc["engine"], model=doc["model"], runtime=doc["runtime"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def generations(self, identity: str) -> list[Generation]:
        """Complete generations of ``identity``, oldest first."""
        idir = self.identity_dir(identity)
        if not idir.is_dir():
            return []
        out = []
        for entry in os.scandir(idir):
            if not (GENERATION_RE.match(entry.name) and entry.is_dir(follow_symlinks=False)):
                continue
            gen = self._read_generation(idir, entry.name)
            if gen is not None:
                out.append(gen)
        return sorted(out, key=lambda g: g.number)

    def _read_generation(self, idir: Path, name: str) -> Generation | None:
        gdir = idir / name
        try:
            doc = json.loads((gdir / GENERATION_FILE).read_text())
            if not isinstance(doc, dict) or doc.get("kind") != GENERATION_KIND or doc.get("number") != int(name):
                return None
            if not (gdir / ARTIFACT_FILE).is_file():
                return None
            return Generation(identity=idir.name, number=int(name), path=gdir, capture_id=doc["capture_id"],
                              artifact_sha256=doc["artifact_sha256"], source=doc.get("source"),
                              promoted_at=doc["promoted_at"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def current(self, identity: str) -> Generation | None:
        """The generation ``current`` points at, or None (no promotion yet)."""
        idir = self.identity_dir(identity)
        try:
            target = os.readlink(idir / CURRENT)
        except (FileNotFoundError, OSError):
            return None
        if not GENERATION_RE.match(target):
            return None
        return self._read_generation(idir, target)

    def load_current(self, identity: str) -> dict:
        """The current descriptor of ``identity``; a clear error when there is none."""
        gen = self.current(identity)
        if gen is None:
            raise ColdSnapError(f"artifact identity {_hex(identity)} has no current generation in {self.root}",
                                fix="capture the workload first (capture promotes its descriptor)")
        return gen.load()

    def find(self, identity: str, artifact_sha256: str) -> Generation | None:
        """The generation holding the descriptor with this digest, if any."""
        return next((g for g in self.generations(identity) if g.artifact_sha256 == artifact_sha256), None)

    def retained_payloads(self, *, exclude: Iterable[str] = ()) -> set[str]:
        """Payload digests referenced by every retained generation and overlay (minus ``exclude`` identities)."""
        return self._retained(exclude)[0]

    def retained_capsules(self, *, exclude: Iterable[str] = ()) -> set[str]:
        """Capsule image ids referenced by every retained generation and overlay (minus ``exclude``)."""
        return self._retained(exclude)[1]

    def _retained(self, exclude: Iterable[str], *, dropping: Iterable[tuple[str, str]] = (),
                  adding: dict | None = None) -> tuple[set[str], set[str]]:
        """(payloads, capsules) the retained descriptors reference; ``dropping`` ((identity hex, descriptor
        digest) pairs) are left out with their overlays, ``adding`` (a descriptor) counted in: what a
        promotion's check mode sees before anything is written or pruned."""
        skip = {_hex(i) for i in exclude}
        gone = set(dropping)
        payloads: set[str] = set()
        capsules: set[str] = set()
        if adding is not None:
            payloads.update(w["payload"]["sha256"] for w in adding["weights"]["workers"] if w.get("payload"))
            capsules.update(c["image_id"] for c in adding["capsule"]["units"])
        if not self.root.is_dir():
            return payloads, capsules
        for entry in os.scandir(self.root):
            if not (HEX_RE.match(entry.name) and entry.is_dir(follow_symlinks=False)) or entry.name in skip:
                continue
            for gen in self.generations(entry.name):
                if (entry.name, gen.artifact_sha256) in gone:
                    continue
                try:
                    art = json.loads(gen.artifact_path.read_text())
                    payloads.update(w["payload"]["sha256"] for w in art["weights"]["workers"] if w.get("payload"))
                    capsules.update(c["image_id"] for c in art["capsule"]["units"])
                except (OSError, ValueError, KeyError, TypeError):
                    continue
            for ov in overlay_mod.list_overlays(self, entry.name):
                if (entry.name, ov["portable_sha256"]) in gone:
                    continue
                payloads.update(ov.get("payloads", []))
                capsules.update(c.get("image_id") for c in ov.get("refs", {}).get("capsules", []) if c.get("image_id"))
        return payloads, capsules

    def _retained_captures(self, exclude: Iterable[str], *, dropping: Iterable[tuple[str, str]] = (),
                           adding: dict | None = None) -> set[str]:
        """Capture ids the retained generations (of identities not in ``exclude``) still restore from: a
        published descriptor keeps its source's capture id, so pruning the source must not remove it.
        ``dropping`` and ``adding`` as for :meth:`_retained`."""
        skip = {_hex(i) for i in exclude}
        gone = set(dropping)
        held: set[str] = {adding["capture_id"]} if adding is not None else set()
        if not self.root.is_dir():
            return held
        for entry in os.scandir(self.root):
            if HEX_RE.match(entry.name) and entry.is_dir(follow_symlinks=False) and entry.name not in skip:
                held.update(g.capture_id for g in self.generations(entry.name)
                            if (entry.name, g.artifact_sha256) not in gone)
        return held

    def holds(self, artifact_sha256: str) -> bool:
        """Whether a generation or overlay of any identity is exactly this descriptor."""
        if not self.root.is_dir():
            return False
        for entry in os.scandir(self.root):
            if not (HEX_RE.match(entry.name) and entry.is_dir(follow_symlinks=False)):
                continue
            if any(g.artifact_sha256 == artifact_sha256 for g in self.generations(entry.name)):
                return True
            if any(o.get("sha256") == artifact_sha256 for o in overlay_mod.list_overlays(self, entry.name)):
                return True
        return False

    # ------------------------------------------------------------- promotion
    def promote(self, artifact_path: Path | str, *, request: dict, retention: int | None = None,
                check_mode: bool = False, hook: Hook | None = None) -> PromoteResult:
        """Make the descriptor at ``artifact_path`` the current generation of its identity.

        The descriptor's identity must be the request's. Promoting a descriptor
        that is already stored points ``current`` at that generation again (a
        rollback), or changes nothing when it already is current. ``retention``
        (default: the request's ``policy.retention.generations``) generations
        are kept, the current one always. ``hook(step)`` is called after
        ``generation-written`` and ``pointer-written`` (tests use it to kill a
        promotion in between).
        """
        from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.artifact import (
            load_artifact,
            read_descriptor_file,
        )

        artifact_path = Path(artifact_path)
        try:
            data = read_descriptor_file(artifact_path)
        except FileNotFoundError:
            raise ColdSnapError(f"artifact {artifact_path} does not exist",
                                fix="promote the artifact.json that capture committed") from None
        artifact = load_artifact(data, document=str(artifact_path))
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        info = identity_info_of(request)
        if artifact["identity"] != f"sha256:{info.identity}":
            raise ColdSnapError(f"artifact {artifact_path} belongs to identity {artifact['identity']}, the request to "
                                f"sha256:{info.identity}",
                                fix="promote a descriptor with the request that captured it (same recipe, model, "
                                    "engine, topology and snapshot driver)")
        keep = int(retention if retention is not None else request["policy"]["retention"]["generations"])
        if keep < 1:
            raise ColdSnapError(f"retention of {keep} generations keeps nothing", fix="keep at least 1 generation")
        if check_mode:
            return self._plan_promote(info, artifact, digest, artifact_path, keep)
        with self.locked(info.identity) as idir:
            self._clean_temps(idir)
            rewrote = self._write_identity(idir, info)
            gens = self.generations(info.identity)
            existing = next((g for g in gens if g.artifact_sha256 == digest), None)
            current = self.current(info.identity)
            created = existing is None
            if existing is not None:
                gen = existing
            else:
                # Above every generation directory, readable or not: a number is never used twice.
                number = max((int(e.name) for e in os.scandir(idir) if GENERATION_RE.match(e.name)), default=0) + 1
                gen = self._write_generation(idir, number, artifact, data, digest=digest, source=artifact_path)
            if hook:
                hook("generation-written")
            changed = created or current is None or current.number != gen.number
            if changed:
                self._point_current(idir, gen.name)
            if hook:
                hook("pointer-written")
            pruned = self._prune(idir, keep)
            keep_payloads, keep_capsules = self._retained(()) if pruned else (set(), set())
            held = self._retained_captures(()) if pruned else set()
        return self._promote_result(info, changed=changed or rewrote or bool(pruned), generation=gen.as_dict(),
                                    created=created, pruned=pruned, held=held, keep=(keep_payloads, keep_capsules))

    def _promote_result(self, info: IdentityInfo, *, changed: bool, generation: dict, created: bool,
                        pruned: list[dict], held: set[str], keep: tuple[set[str], set[str]]) -> PromoteResult:
        cleanup = [_keeping_captures(p["refs"], held) for p in pruned] + [
            _keeping_captures(o["refs"], held) for p in pruned for o in p["overlays"]]
        hosts = sorted({h for r in cleanup for h in r["hosts"]})
        return PromoteResult(changed=changed, generation=generation,
                             current=str(self.current_artifact_path(info.identity)), created=created,
                             pruned=pruned, cleanup=cleanup, keep_payloads=sorted(keep[0]), cleanup_hosts=hosts,
                             keep_capsules=sorted(keep[1]))

    def _plan_promote(self, info: IdentityInfo, artifact: dict, digest: str, source: Path, keep: int) -> PromoteResult:
        """What :meth:`promote` would do, reported the same way, with nothing written or removed."""
        gens = self.generations(info.identity)
        existing = next((g for g in gens if g.artifact_sha256 == digest), None)
        current = self.current(info.identity)
        if existing is not None:
            number, created = existing.number, False
        else:
            # As promote numbers it: above every generation directory, readable or not.
            idir = self.identity_dir(info.identity)
            on_disk = [int(e.name) for e in os.scandir(idir) if GENERATION_RE.match(e.name)] if idir.is_dir() else []
            number, created = max(on_disk, default=0) + 1, True
        changed = (created or current is None or current.number != number
                   or not self._identity_written(self.identity_dir(info.identity), info))
        numbers = sorted({g.number for g in gens} | {number})
        kept = set(numbers[-keep:]) | {number}
        doomed = [g for g in gens if g.number not in kept]
        pruned = [{**self._describe_pruned(info.identity, g), "source_removed": _source_matches(g)} for g in doomed]
        if existing is not None:
            generation = existing.as_dict()
        else:
            generation = {"identity": f"sha256:{info.identity}", "generation": f"{number:06d}", "number": number,
                          "capture_id": artifact["capture_id"], "artifact_sha256": digest, "source": str(source)}
        dropping = [(info.identity, g.artifact_sha256) for g in doomed]
        adding = artifact if created else None
        keep_sets = self._retained((), dropping=dropping, adding=adding) if pruned else (set(), set())
        held = self._retained_captures((), dropping=dropping, adding=adding) if pruned else set()
        return self._promote_result(info, changed=changed or bool(pruned), generation=generation, created=created,
                                    pruned=pruned, held=held, keep=keep_sets)

    def _describe_pruned(self, identity: str, g: Generation) -> dict:
        """A generation about to be pruned: its host-local references and those of its overlays."""
        try:
            refs = local_refs(g.load(), artifact_sha256=g.artifact_sha256)
        except ColdSnapError:
            refs = {"capture_id": g.capture_id, "capsules": [], "payloads": [], "hosts": []}
        overlays = [o for o in overlay_mod.list_overlays(self, identity) if o["portable_sha256"] == g.artifact_sha256]
        return {"generation": g.as_dict(), "refs": refs, "overlays": overlays}

    @staticmethod
    def _identity_doc(info: IdentityInfo) -> dict:
        return {"format": STORE_FORMAT, "kind": IDENTITY_KIND, **info.as_dict()}

    def _identity_written(self, idir: Path, info: IdentityInfo) -> bool:
        try:
            return json.loads((idir / IDENTITY_FILE).read_text()) == self._identity_doc(info)
        except (OSError, ValueError):
            return False

    def _write_identity(self, idir: Path, info: IdentityInfo) -> bool:
        """Write the identity's ``identity.json`` unless it already says this; True when written."""
        if self._identity_written(idir, info):
            return False
        atomic_write_json(idir / IDENTITY_FILE, self._identity_doc(info))
        return True

    def _write_generation(self, idir: Path, number: int, artifact: dict, data: bytes, *, digest: str,
                          source: Path) -> Generation:
        name = f"{number:06d}"
        meta = (json.dumps({
            "format": STORE_FORMAT, "kind": GENERATION_KIND, "number": number,
            "identity": artifact["identity"], "capture_id": artifact["capture_id"],
            "artifact_sha256": digest, "source": str(source.resolve()), "promoted_at": _now(),
        }, indent=2, sort_keys=True) + "\n").encode()
        tmp = temp_path_for(idir / name)
        os.mkdir(tmp, 0o700)
        try:
            for fname, content in ((ARTIFACT_FILE, data), (GENERATION_FILE, meta)):
                # Private, as capture's own artifact.json: a descriptor names hosts, paths and the launch.
                with os.fdopen(os.open(tmp / fname, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as fh:
                    fh.write(content)
                    fh.flush()
                    os.fsync(fh.fileno())
            fsync_dir(tmp)
            os.rename(tmp, idir / name)
            fsync_dir(idir)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        gen = self._read_generation(idir, name)
        if gen is None:  # just committed under the lock: it must read back
            raise AssertionError(f"generation {name} of {idir} does not read back after its commit")
        return gen

    def _point_current(self, idir: Path, name: str) -> None:
        tmp = temp_path_for(idir / CURRENT)
        os.symlink(name, tmp)
        os.replace(tmp, idir / CURRENT)
        fsync_dir(idir)

    def _clean_temps(self, idir: Path) -> None:
        """Remove what killed writers left (caller holds the identity lock)."""
        for entry in os.scandir(idir):
            if is_temp_name(entry.name):
                p = Path(entry.path)
                if entry.is_dir(follow_symlinks=False):
                    shutil.rmtree(p, ignore_errors=True)
                else:
                    with contextlib.suppress(FileNotFoundError):
                        p.unlink()
            # A generation under its final name was complete when renamed there: one that does not read now
            # (an I/O error, a damaged byte) is left alone, never taken for debris.

    def _prune(self, idir: Path, keep: int) -> list[dict]:
        """Drop generations beyond the newest ``keep`` (never the current one); return what went."""
        gens = self.generations(idir.name)
        current = self.current(idir.name)
        kept = {g.number for g in gens[-keep:]} | ({current.number} if current else set())
        pruned = []
        for g in gens:
            if g.number in kept:
                continue
            described = self._describe_pruned(idir.name, g)
            overlay_mod.remove_overlays_of(self, idir.name, g.artifact_sha256)
            rmtree_atomically(g.path)
            pruned.append({**described, "source_removed": _remove_source(g)})
        return pruned

    # ----------------------------------------------------------------- delete
    def delete(self, *, recipe: str, snapshot_driver: str, identities: Iterable[str] = (),
               extra_artifacts: Iterable[tuple[dict, str | None]] = (), check_mode: bool = False) -> DeleteResult:
        """Remove every stored descriptor of ``recipe`` + ``snapshot_driver`` (and of ``identities``).

        Returns the host-local references of everything removed (for
        :func:`.cleanup.remove_local`) and the payload digests that retained
        descriptors of other identities still reference (never removed).
        ``extra_artifacts`` are (descriptor, digest) pairs outside the store
        (e.g. the request's own artifact) whose local artifacts go too.
        """
        wanted = {_hex(i) for i in identities}
        infos = [i for i in self.identities()
                 if (i.recipe == recipe and i.snapshot_driver == snapshot_driver) or i.identity in wanted]
        doomed = {i.identity for i in infos} | {w for w in wanted if self.identity_dir(w).is_dir()}
        removed: list[dict] = []
        sources: list[str] = []
        seen_captures: set[str] = set()
        for ident in sorted(doomed):
            for g in self.generations(ident):
                try:
                    refs = local_refs(g.load(), artifact_sha256=g.artifact_sha256)
                except ColdSnapError:
                    refs = {"kind": "generation", "capture_id": g.capture_id, "capsules": [], "payloads": [],
                            "hosts": []}
                removed.append({"generation": g.as_dict(), "refs": refs})
                seen_captures.add(g.capture_id)
                if g.source and _source_matches(g):
                    sources.append(g.source)
            for ov in overlay_mod.list_overlays(self, ident):
                removed.append({"overlay": ov["path"], "refs": ov["refs"]})
                seen_captures.add(ov["refs"]["capture_id"])
        for art, digest in extra_artifacts:
            if art["capture_id"] not in seen_captures:
                removed.append({"artifact": digest, "refs": local_refs(art, artifact_sha256=digest)})
                seen_captures.add(art["capture_id"])
        changed = bool(doomed) or bool(removed)
        if not check_mode:
            for ident in sorted(doomed):
                with self.locked(ident) as idir:
                    for g in self.generations(ident):
                        _remove_source(g)
                    rmtree_atomically(idir / CURRENT)
                    # Moved away while the lock is held: a promotion waiting for it finds the lock file gone
                    # with the directory and starts afresh instead of writing into what is being removed.
                    gone = temp_path_for(idir)
                    os.rename(idir, gone)
                    fsync_dir(idir.parent)
                # The lock file lives inside: remove the directory after releasing it.
                shutil.rmtree(gone, ignore_errors=True)
        keep, keep_caps = (sorted(x) for x in self._retained(doomed))
        held = self._retained_captures(doomed)
        cleanup = [_keeping_captures(r["refs"], held) for r in removed]
        hosts = sorted({h for r in cleanup for h in r.get("hosts", [])})
        return DeleteResult(changed=changed, identities=[i.as_dict() for i in infos], removed=removed,
                            sources=sources, cleanup=cleanup, keep_payloads=keep, cleanup_hosts=hosts,
                            keep_capsules=keep_caps)


def _keeping_captures(refs: dict, held: set[str]) -> dict:
    """``refs`` without its capture directory when a retained descriptor still restores from it."""
    if refs.get("capture_id") in held:
        return {**refs, "capture_id": None, "capture_kept": "a retained descriptor restores from it"}
    return refs


def _source_matches(gen: Generation) -> bool:
    """The committed output descriptor still holds exactly what was promoted (and lives outside the store)."""
    if not gen.source:
        return False
    src = Path(gen.source)
    try:
        return src.is_file() and gen.path not in src.resolve().parents and file_sha256(src) == gen.artifact_sha256
    except OSError:
        return False


def _remove_source(gen: Generation) -> bool:
    """Remove the capture's committed output descriptor of a dropped generation when it is unchanged."""
    if not _source_matches(gen):
        return False
    src = Path(gen.source or "")
    src.unlink()
    fsync_dir(src.parent)
    with contextlib.suppress(OSError):
        src.parent.rmdir()  # only when empty
    return True
