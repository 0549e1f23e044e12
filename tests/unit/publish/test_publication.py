"""Published descriptors, native payload objects and the docker-runtime helpers that need no daemon."""

from __future__ import annotations

import copy
import hashlib
import json
import os
from pathlib import Path

import pytest
from ansible_collections.coldsnap.fleet.plugins.module_utils.artifacts import publication as pub
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import (
    ColdSnapError,
    FormatError,
    IntegrityError,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.artifact import load_artifact
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.unit import UnitSpec
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.publish import (
    check_target,
    payload_objects,
    resolve_revision,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.units import docker_runtime as dr
from ansible_collections.coldsnap.fleet.plugins.module_utils.units import ownership
from ansible_collections.coldsnap.fleet.plugins.module_utils.units.ownership import Owner

FIXTURE = Path(__file__).resolve().parents[2] / "fixtures" / "artifacts" / "reference-tiny-n610.json"
REPO = "127.0.0.1:5000/coldsnap/capsules"


def source(tmp_path: Path, art: dict | None = None) -> tuple[Path, dict, str]:
    art = art or json.loads(FIXTURE.read_text())
    path = tmp_path / "accepted" / "artifact.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    data = (json.dumps(art, indent=2) + "\n").encode()
    path.write_bytes(data)
    return path, art, "sha256:" + hashlib.sha256(data).hexdigest()


def pushed(art: dict, digest: str = "1" * 64) -> list[dict]:
    return [{"unit": c["unit"], "image_id": c["image_id"], "repository_digest": f"{REPO}@sha256:{digest}"}
            for c in art["capsule"]["units"]]


def test_publishing_capsules_writes_a_separate_published_descriptor(tmp_path):
    path, art, digest = source(tmp_path)
    before = path.read_bytes()
    out = pub.publish_descriptor(source=path, source_sha256=digest, artifact_dir=tmp_path / "published",
                                 capsules=pushed(art), repository=REPO)
    assert out["changed"] is True and out["parent"] == digest
    assert path.read_bytes() == before, "the source is never rewritten"
    doc = load_artifact(Path(out["path"]).read_bytes())
    assert doc["state"] == "published" and doc["parent"] == digest
    assert doc["capsule"]["units"][0]["repository_digest"] == f"{REPO}@sha256:{'1' * 64}"
    assert out["sha256"] == pub.file_digest(Path(out["path"]))

    # Everything else is the source's own content.
    def keep(a: dict) -> dict:
        return {k: v for k, v in a.items() if k not in ("capsule", "state", "parent", "created_at")}

    assert keep(doc) == keep(load_artifact(json.dumps(art)))  # (defaults filled in, as any reader sees it)


def test_publication_is_content_idempotent_and_never_replaces(tmp_path):
    path, art, digest = source(tmp_path)
    kw = {"source": path, "source_sha256": digest, "artifact_dir": tmp_path / "published", "repository": REPO}
    first = pub.publish_descriptor(capsules=pushed(art), **kw)
    data = Path(first["path"]).read_bytes()
    again = pub.publish_descriptor(capsules=pushed(art), **kw)
    assert again["changed"] is False and Path(again["path"]).read_bytes() == data
    with pytest.raises(ColdSnapError, match="never replaced"):
        pub.publish_descriptor(capsules=pushed(art, "2" * 64), **kw)
    with pytest.raises(ColdSnapError, match="separate one"):
        pub.publish_descriptor(capsules=pushed(art), **{**kw, "artifact_dir": path.parent})


def test_check_mode_commits_nothing(tmp_path):
    path, art, digest = source(tmp_path)
    out = pub.publish_descriptor(source=path, source_sha256=digest, artifact_dir=tmp_path / "p", capsules=pushed(art),
                                 repository=REPO, check_mode=True)
    assert out["changed"] is True and not (tmp_path / "p" / "artifact.json").exists()


def test_check_mode_before_the_first_push_says_what_a_real_run_would_commit(tmp_path):
    """A check run's push only announces itself (no digest): the commit answers with the would-be descriptor,
    never 'was not pushed', and a native publication whose upload is still to come likewise."""
    path, art, digest = source(tmp_path)
    announced = [{**e, "repository_digest": None} for e in pushed(art)]
    kw = {"source": path, "source_sha256": digest, "artifact_dir": tmp_path / "p", "check_mode": True}
    out = pub.publish_descriptor(capsules=announced, repository=REPO, **kw)
    assert out["changed"] is True and out["pending"] is True and out["parent"] == digest
    assert out["artifact"]["state"] == "published"
    assert [u["repository_digest"] for u in out["artifact"]["capsule"]["units"]] == [None] * len(announced)
    native = pub.publish_descriptor(native={"repository": "acme/payloads", "revision": None}, **kw)
    assert native["pending"] and native["artifact"]["weights"]["providers"]["native"]["revision"] is None
    assert not (tmp_path / "p").exists(), "check mode writes nothing"
    with pytest.raises(ColdSnapError, match="was not pushed"):  # only check mode takes an announcement
        pub.publish_descriptor(capsules=announced, repository=REPO, **{**kw, "check_mode": False})
    with pytest.raises(ColdSnapError, match="separate one"):  # and it refuses what a real run refuses
        pub.publish_descriptor(capsules=announced, repository=REPO, **{**kw, "artifact_dir": path.parent})


@pytest.mark.parametrize("bad, match", [
    (lambda e: e.pop(), "was not pushed"),
    (lambda e: e[0].update(image_id="sha256:" + "9" * 64), "descriptor records"),
    (lambda e: e[0].update(repository_digest="127.0.0.1:5000/elsewhere@sha256:" + "1" * 64), "not an immutable"),
    (lambda e: e.append({**e[0], "unit": "unit-9"}), "unknown units"),
])
def test_pushed_capsules_must_be_exactly_the_recorded_ones(tmp_path, bad, match):
    path, art, digest = source(tmp_path)
    entries = pushed(art)
    bad(entries)
    with pytest.raises(ColdSnapError, match=match):
        pub.publish_descriptor(source=path, source_sha256=digest, artifact_dir=tmp_path / "p", capsules=entries,
                               repository=REPO)
    assert not (tmp_path / "p").exists()


def test_the_native_provider_records_a_commit_never_a_branch(tmp_path):
    path, _art, digest = source(tmp_path)
    kw = {"source": path, "source_sha256": digest, "artifact_dir": tmp_path / "native"}
    with pytest.raises(ColdSnapError, match="immutable commit"):
        pub.publish_descriptor(native={"repository": "acme/payloads", "revision": "main"}, **kw)
    out = pub.publish_descriptor(native={"repository": "acme/payloads", "revision": "c" * 40}, **kw)
    doc = out["artifact"]
    assert doc["weights"]["providers"]["native"] == {"repository": "acme/payloads", "revision": "c" * 40}
    assert doc["state"] == "accepted", "native publication alone does not make the capsules registry-backed"


def test_the_source_must_be_the_pinned_valid_descriptor_of_this_workload(tmp_path):
    path, art, _digest = source(tmp_path)
    with pytest.raises(IntegrityError, match="request pins"):
        pub.load_source(path, expected_sha256="sha256:" + "0" * 64)
    broken = copy.deepcopy(art)
    broken["capsule"]["units"] = []
    bad_path, _a, _d = source(tmp_path / "b", broken)
    with pytest.raises(FormatError):
        pub.load_source(bad_path)
    with pytest.raises(ColdSnapError, match="does not exist"):
        pub.load_source(tmp_path / "missing.json")
    assert pub.capture_hosts(art) == ["localhost"]


def test_payload_objects_are_distinct_digests_owned_by_the_first_workers_host():
    art = json.loads(FIXTURE.read_text())
    w0 = art["weights"]["workers"][0]
    art["capsule"]["units"].append({**art["capsule"]["units"][0], "unit": "unit-1", "host": "hostb"})
    art["weights"]["workers"].append({**copy.deepcopy(w0), "worker": "worker-1", "unit": "unit-1", "rank": 1})
    (obj,) = payload_objects(art)
    assert obj.workers == ("worker-0", "worker-1") and obj.hosts == ("localhost", "hostb")
    assert obj.upload_host == "localhost" and obj.path == w0["payload"]["path"]
    art["weights"]["workers"][1]["payload"] = None
    assert payload_objects(art)[0].workers == ("worker-0",)
    for repo, branch in (("no-slash", "main"), ("acme/x", "../main"), ("acme/x", "")):
        with pytest.raises(ColdSnapError):
            check_target(repo, branch)


def test_owner_forms():
    assert ownership.parse_owner("1001:1002") == Owner(1001, 1002)
    assert ownership.parse_owner({"uid": 5, "gid": "6"}) == Owner(5, 6)
    assert ownership.parse_owner(None) is None and ownership.parse_owner("") is None
    for bad in ("1001", "a:b", {"uid": 1}, "-1:3"):
        with pytest.raises(ColdSnapError):
            ownership.parse_owner(bad)


def test_specs_are_made_valid_inside_the_container():
    spec = UnitSpec(operation="restore", operation_id="op", capture_id="c", unit={"id": "unit-0", "index": 0,
                    "devices": [3, 5]}, workers=[], world_size=1, unit_count=1, state_root="/s", unit_dir="/s/u",
                    workload_dir="/s/w", python="/usr/bin/python3.11", model={}, driver={}, criu_binary="/opt/criu",
                    supervise=False)
    out = dr.docker_spec(spec, unit_dir="/s/c/u", supervise=True)
    assert out.python == dr.DOCKER_PYTHON and out.criu_binary is None and out.supervise is True
    assert out.unit["devices"] == [0, 1], "GPUs handed to a container are numbered from 0 inside it"
    assert out.unit_dir == "/s/c/u" and spec.unit["devices"] == [3, 5]
    argv = dr._controller_argv("capture", Path("/r/spec.json"), Path("/r/ev.json"), raise_pids=True)
    assert argv[:2] == ["/bin/sh", "-c"] and f"echo {dr.PID_FLOOR - 1} > /proc/sys/kernel/ns_last_pid" in argv[2]
    assert argv[3:] == ["coldsnap-rank", dr.DOCKER_PYTHON, "-m", "coldsnap_activation", "capture", "--spec",
                        "/r/spec.json", "--evidence", "/r/ev.json"], "exec keeps the controller as PID 1"
    assert dr._controller_argv("restore", Path("/s"), Path("/e"), raise_pids=False)[0] == dr.DOCKER_PYTHON


def test_model_mounts_are_read_only_and_the_recovery_source_is_visible(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    req = {"launch": {"model": {"source": {"kind": "local-safetensors", "path": str(model)}}}}
    unit = {"id": "unit-0", "mounts": [{"source": str(model), "target": "/models/m", "read_only": True}]}
    # The source path is not under any target: it is bound read-only at its own path as well.
    mounts = dr.model_mounts(req, unit)
    assert {(m["target"], m["read_only"], m["kind"]) for m in mounts} == {("/models/m", True, "model"),
                                                                          (str(model), True, "model")}
    unit["mounts"][0]["target"] = str(model)
    unit["mounts"][0]["read_only"] = False
    with pytest.raises(ColdSnapError, match="writable"):
        dr.model_mounts(req, unit)


@pytest.mark.parametrize("where", ["/", "/etc", "/var/run"])
def test_a_mount_source_that_links_to_a_host_tree_is_refused_on_the_host(tmp_path, where):
    """The request's rule sees the path as written; the host binds what it resolves to: a link to / in a
    model directory would put the host's root (writable) into the container."""
    link = tmp_path / "models" / "rootlink"
    link.parent.mkdir()
    link.symlink_to(where)
    req = {"launch": {"model": {"source": {"kind": "local-safetensors", "path": str(tmp_path / "models")}}}}
    unit = {"id": "unit-0", "mounts": [{"source": str(link), "target": "/hostroot", "read_only": False}]}
    real = os.path.realpath(where)  # /var/run is itself a link to /run
    with pytest.raises(ColdSnapError, match=f"resolves to {real} on this host"):
        dr.model_mounts(req, unit)
    req["launch"]["model"]["source"]["path"] = str(link)  # the recovery source bound at its own path
    with pytest.raises(ColdSnapError, match=f"resolves to {real} on this host"):
        dr.model_mounts(req, {"id": "unit-0", "mounts": []})


def test_a_model_directory_reached_through_a_link_is_bound_as_what_it_is(tmp_path):
    real = tmp_path / "data" / "llama"
    real.mkdir(parents=True)
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "llama").symlink_to(real)
    req = {"launch": {"model": {"source": {"kind": "local-safetensors", "path": "/models/llama"}}}}
    unit = {"id": "unit-0", "mounts": [{"source": str(tmp_path / "models" / "llama"), "target": "/models/llama",
                                        "read_only": True}]}
    assert dr.model_mounts(req, unit) == [{"source": str(real), "target": "/models/llama", "read_only": True,
                                           "kind": "model"}]


def test_an_unreachable_registry_is_no_answer_to_whether_a_capsule_is_there() -> None:
    """Only the registry's "not found" counts as absent: check mode must not promise a push that the real
    run cannot make (and a real run must not push because a lookup failed)."""
    from ansible_collections.coldsnap.fleet.plugins.module_utils.capsule.publish import remote_has
    from ansible_collections.coldsnap.fleet.plugins.module_utils.capsule.registry import RegistryError

    with pytest.raises(RegistryError, match="unreachable"):
        remote_has("127.0.0.1:1/coldsnap/capsules@sha256:" + "a" * 64, insecure=True)


@pytest.mark.parametrize(("error", "says"), [
    ("Head https://r:5000/v2/c/manifests/sha256:ab: no basic auth credentials", "credentials for r:5000/c"),
    ("unauthorized: authentication required", "credentials for r:5000/c"),
    ("manifest for r:5000/c@sha256:ab not found: manifest unknown", "no longer in r:5000/c"),
    ("Get https://r:5000/v2/: dial tcp: connection refused", "unreachable"),
])
def test_a_refused_capsule_pull_says_what_to_do_about_its_reason(error, says):
    """A restore whose pull the daemon refuses for credentials or a capsule gone from the registry names that
    fix (it used to blame an unreachable registry or corrupt bytes for both)."""
    from ansible_collections.coldsnap.fleet.plugins.module_utils.capsule.publish import _pull_fix

    assert says in _pull_fix(error, "r:5000/c")


class HubStandinRefs:
    """A stand-in for the Hugging Face Hub client (the Hub cannot be reached from here): a repository with
    one branch whose files are listed as ``{path: (sha256 hex, size)}``."""

    def __init__(self, branch: str | None, files: dict[str, tuple[str, int]]) -> None:
        self.branch, self.files = branch, files

    def list_repo_refs(self, repository):
        from types import SimpleNamespace

        return SimpleNamespace(branches=[SimpleNamespace(name=self.branch, target_commit="d" * 40)]
                               if self.branch else [])

    def get_paths_info(self, repository, paths, revision):
        from types import SimpleNamespace

        return [SimpleNamespace(path=p, size=self.files[p][1], lfs=SimpleNamespace(sha256=self.files[p][0]))
                for p in paths if p in self.files]


@pytest.mark.parametrize("branch", [None, "main"])
def test_hub_standin_resolving_before_the_upload_is_pending_in_check_mode_only(branch):
    art = json.loads(FIXTURE.read_text())
    objects = payload_objects(load_artifact(json.dumps(art)))
    kw = {"artifact": load_artifact(json.dumps(art)), "repository": "acme/payloads", "branch": "main",
          "token": None, "endpoint": None, "api": HubStandinRefs(branch, {})}
    out = resolve_revision(check_mode=True, **kw)
    assert out["pending"] is True and out["revision"] is None and len(out["objects"]) == len(objects)
    with pytest.raises(ColdSnapError, match="does not exist" if branch is None else "does not hold the payloads"):
        resolve_revision(**kw)
    held = {o.path: (o.sha256.split(":", 1)[1], o.size) for o in objects}
    done = resolve_revision(check_mode=True, **{**kw, "api": HubStandinRefs("main", held)})
    assert done["revision"] == "d" * 40 and "pending" not in done
