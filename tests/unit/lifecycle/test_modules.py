"""The lifecycle modules run by Ansible itself (AnsiballZ): check mode, changed, then not changed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from lifecycle_helpers import make_artifact, make_request, put_pack, write_artifact
from module_runner import HAVE_ANSIBLE, run_module

from coldsnap._collection import collection_root

pytestmark = pytest.mark.skipif(not HAVE_ANSIBLE, reason="ansible-core is not installed in this environment")


def test_artifact_store_promoted_check_mode_then_idempotent(state_root, tmp_path):
    req = make_request()
    path = write_artifact(tmp_path / "out", make_artifact(req, capture_id="cap-1"))
    args = {"state": "promoted", "request": req, "artifact_path": str(path), "state_root": str(state_root)}
    dry = run_module("artifact_store", args, "--check")
    assert dry["changed"] and dry["generation"]["generation"] == "000001", dry
    assert not (state_root / "artifacts").exists()
    first = run_module("artifact_store", args)
    assert first["changed"] and Path(first["current"]).read_bytes() == path.read_bytes()
    second = run_module("artifact_store", args)
    assert not second["changed"] and not second.get("failed")
    query = run_module("artifact_store", {"state": "query", "request": req, "artifact_path": str(path),
                                          "state_root": str(state_root)})
    assert not query["changed"] and [g["capture_id"] for g in query["generations"]] == ["cap-1"]
    on_a_directory = run_module("artifact_store", {"state": "query", "request": req, "artifact_path": str(tmp_path),
                                                   "facts": {}, "state_root": str(state_root)})
    assert on_a_directory["failed"] and "is not a regular file" in on_a_directory["msg"], on_a_directory["msg"]


def test_artifact_store_refusals_name_the_fix(state_root, tmp_path):
    req = make_request()
    other = make_request(recipe="other")
    path = write_artifact(tmp_path / "out", make_artifact(other, capture_id="cap-9"))
    res = run_module("artifact_store", {"state": "promoted", "request": req, "artifact_path": str(path),
                                        "state_root": str(state_root)})
    assert res["failed"] and "belongs to identity" in res["msg"] and "promote a descriptor" in res["msg"]
    res = run_module("artifact_store", {"state": "absent", "request": req, "artifact_path": str(path),
                                        "state_root": str(state_root)})
    # Never committed by this store (and not pinned by digest): deleting it is refused, naming both ways out.
    assert res["failed"] and "is not a descriptor the artifact store holds" in res["msg"], res["msg"]
    assert "artifact.sha256" in res["msg"]
    assert path.exists()


@pytest.mark.parametrize("module, args, needle", [
    ("artifact_leftovers", {"refs": [{"capture_id": "c", "capsules": [{"unit": "u", "image_id": "sha256:" + "a" * 64}]}],
                            "host": "localhost"}, "refs[0].capsules[0]: 'layout' is missing"),
    ("artifact_leftovers", {"refs": [{"payloads": [{"size": 3}]}], "host": "localhost"},
     "refs[0].payloads[0]: 'sha256' is missing"),
    ("artifact_leftovers", {"refs": [{"capture_id": 5}], "host": "localhost"}, "refs[0].capture_id: 5 is not a string"),
    # a misspelt field removed nothing and reported ok: refused by name
    ("artifact_leftovers", {"refs": [{"capture_ids": "c", "payload": []}], "host": "localhost"},
     "refs[0]: unknown field(s) capture_ids, payload"),
    ("artifact_leftovers", {"refs": [{"capsules": [{"unit": "u", "image_id": "x", "layout": "zip"}]}],
                            "host": "localhost"}, "refs[0].capsules[0].layout: 'zip' is not one of"),
    ("capsule_publish", {"state": "verified", "capsules": [{"unit": "u"}]}, "capsule entry 'u': 'layout' is missing"),
])
def test_malformed_entries_of_list_options_are_refused_by_name(state_root, module, args, needle):
    before = sorted(str(p) for p in state_root.rglob("*"))
    res = run_module(module, {**args, "state_root": str(state_root)})
    assert res.get("failed") and needle in res["msg"], res
    assert "Traceback" not in json.dumps(res) and "KeyError" not in res["msg"]
    assert sorted(str(p) for p in state_root.rglob("*")) == before


def test_delete_then_local_artifacts_converge(state_root, tmp_path):
    sha, size = put_pack(state_root, b"capture-local bytes")
    req = make_request()
    art = make_artifact(req, capture_id="cap-1", pack=(sha, size), state_root=state_root)
    (state_root / "captures" / "cap-1" / "units" / "unit-0").mkdir(parents=True)
    path = write_artifact(tmp_path / "out", art)
    run_module("artifact_store", {"state": "promoted", "request": req, "artifact_path": str(path),
                                  "state_root": str(state_root)})
    delete = {"state": "absent", "request": make_request(operation="delete", artifact=path),
              "artifact_path": str(path), "state_root": str(state_root)}
    gone = run_module("artifact_store", delete)
    assert gone["changed"] and gone["cleanup"][0]["capture_id"] == "cap-1" and sha not in gone["keep_payloads"]
    local = {"refs": gone["cleanup"], "keep_payloads": gone["keep_payloads"], "host": "localhost",
             "state_root": str(state_root)}
    dry = run_module("artifact_leftovers", local, "--check")
    assert dry["changed"] and (state_root / "captures" / "cap-1").exists()
    first = run_module("artifact_leftovers", local)
    assert first["changed"] and first["removed"]["payloads"][0]["sha256"] == sha
    assert not (state_root / "captures" / "cap-1").exists()
    assert not run_module("artifact_leftovers", local)["changed"]
    assert not run_module("artifact_store", delete)["changed"]


def test_native_status_module_reports_without_changing(state_root):
    sha, size = put_pack(state_root, b"weights")
    req = make_request(operation="native-status")
    art = make_artifact(req, capture_id="c", pack=(sha, size))
    res = run_module("native_status", {"request": req, "artifact": art, "host": "localhost",
                                       "state_root": str(state_root)})
    assert not res["changed"] and res["workers"][0]["state"] == "verified" and res["summary"] == {"verified": 1}


def test_delete_refuses_a_hand_edited_descriptor_and_never_follows_its_locations(state_root, tmp_path):
    """A descriptor the store does not hold (or the request does not pin) cannot steer delete: its
    capsule location pointing at model-payloads/ and another recipe's retained capsule id remove nothing."""
    sha, size = put_pack(state_root, b"someone else's model")
    other_req = make_request(recipe="other")
    other = make_artifact(other_req, capture_id="cap-other", pack=(sha, size), state_root=state_root)
    other_cap = Path(other["capsule"]["units"][0]["location"])
    other_cap.mkdir(parents=True)
    (other_cap / "index.json").write_text("{}")
    run_module("artifact_store", {"state": "promoted", "request": other_req, "state_root": str(state_root),
                                  "artifact_path": str(write_artifact(tmp_path / "other", other))})
    req = make_request()
    mine = make_artifact(req, capture_id="cap-mine", state_root=state_root)
    run_module("artifact_store", {"state": "promoted", "request": req, "state_root": str(state_root),
                                  "artifact_path": str(write_artifact(tmp_path / "mine", mine))})
    evil = json.loads(json.dumps(mine))
    evil["capsule"]["units"][0]["location"] = str(state_root / "model-payloads")
    evil["capsule"]["units"][0]["image_id"] = other["capsule"]["units"][0]["image_id"]
    evil_path = write_artifact(tmp_path / "evil", evil)
    res = run_module("artifact_store", {"state": "absent", "state_root": str(state_root), "artifact_path":
                                        str(evil_path), "request": make_request(operation="delete",
                                                                                artifact=evil_path)})
    assert res["failed"] and "not a descriptor the artifact store holds" in res["msg"], res
    assert evil_path.exists()
    # Even refs from such a descriptor, handed to the host side directly, remove nothing they name.
    from ansible_collections.coldsnap.fleet.plugins.module_utils.artifacts.leftovers import remove_local
    from ansible_collections.coldsnap.fleet.plugins.module_utils.artifacts.refs import local_refs
    from ansible_collections.coldsnap.fleet.plugins.module_utils.artifacts.store import ArtifactStore

    store = ArtifactStore(state_root)
    out = remove_local(state_root, [local_refs(evil)], keep_payloads=sorted(store.retained_payloads()),
                       keep_capsules=sorted(store.retained_capsules()), host="localhost")
    assert (state_root / "model-payloads" / "sha256" / f"{sha.split(':')[1]}.pack").exists()
    assert other_cap.is_dir(), "another recipe's retained capsule stays"
    assert any(k["image_id"] == other["capsule"]["units"][0]["image_id"] for k in out["kept"]["capsules"])


def test_unit_lifecycle_needs_the_activation_runtime_only_to_sleep_or_wake(state_root):
    """Run as Ansible ships it (the module's own small set of library files): status and stop of a
    workload that does not run here answer without the activation runtime; sleep asks for it to be
    staged first (``activation_staged: false``), and the role then stages it and asks again."""
    digest = "sha256:" + "ab" * 32  # never staged under this state root
    base = {"host": "localhost", "state_root": str(state_root), "activation_digest": digest,
            "activation_required": False}
    for state, op in (("status", "status"), ("stopped", "stop")):
        res = run_module("unit_lifecycle", {**base, "state": state,
                                            "request": make_request(operation=op, op_id=f"op-{op}")})
        assert not res.get("failed"), res
        assert res["activation_staged"] is True
        assert [(u["unit"], u["state"]) for u in res["units"]] == [("unit-0", "stopped")]
    res = run_module("unit_lifecycle", {**base, "state": "sleeping",
                                        "request": make_request(operation="sleep", op_id="op-sleep")})
    assert not res.get("failed"), res
    assert (res["activation_staged"], res["changed"], res["units"]) == (False, False, [])
    assert not (state_root / "activation-runtime").exists()


def test_activation_runtime_stages_from_its_files_in_one_task_check_mode_then_idempotent(state_root):
    """The role's path (the lookup's file map in the task's own arguments): check mode writes nothing,
    the first run stages exactly the digest, the second changes nothing; a wrong digest stages nothing."""
    from ansible_collections.coldsnap.fleet.plugins.module_utils.units import activation_stage

    src = collection_root() / "ansible_collections" / "coldsnap" / "fleet" / "runtime_image" / "activation"
    files, digest = activation_stage.file_map(src), activation_stage.tree_digest(src)
    args = {"files": files, "digest": digest, "state_root": str(state_root)}
    check = run_module("activation_runtime", args, "--check")
    assert (check["changed"], check["staged"]) == (True, False)
    assert not activation_stage.staged_path(state_root, digest).exists()
    first = run_module("activation_runtime", args)
    assert (first["changed"], first["staged"], first["digest"]) == (True, True, digest)
    assert activation_stage.require_staged(state_root, digest) == Path(first["path"])
    assert run_module("activation_runtime", args)["changed"] is False
    wrong = run_module("activation_runtime", {**args, "digest": "sha256:" + "0" * 64})
    assert wrong["failed"] and "expected sha256:" + "0" * 64 in wrong["msg"]
    assert not activation_stage.staged_path(state_root, "sha256:" + "0" * 64).exists()
    both = run_module("activation_runtime", {**args, "src": str(src)})
    assert both["failed"] and "mutually exclusive" in both["msg"]


def test_activation_runtime_check_mode_refuses_what_a_real_run_refuses(state_root, tmp_path):
    """A wrong digest, a name that is not a plain relative path, a src that does not exist or holds no
    runtime: the same refusal in check mode as in a real run, and nothing written."""
    from ansible_collections.coldsnap.fleet.plugins.module_utils.units import activation_stage

    src = collection_root() / "ansible_collections" / "coldsnap" / "fleet" / "runtime_image" / "activation"
    files, digest = activation_stage.file_map(src), activation_stage.tree_digest(src)
    cases = [
        ({"files": files, "digest": "sha256:" + "0" * 64}, "expected sha256:" + "0" * 64),
        ({"files": {**files, "../evil": {"content": "eA=="}}, "digest": digest}, "not a plain relative path"),
        ({"files": {**files, "x.py": {"content": "not base64!"}}, "digest": digest}, "not valid base64"),
        ({"src": str(tmp_path / "does-not-exist")}, "does not exist"),
        ({"src": str(tmp_path)}, "not an activation runtime directory"),
    ]
    for args, needle in cases:
        for extra in (("--check",), ()):
            res = run_module("activation_runtime", {**args, "state_root": str(state_root)}, *extra)
            assert res.get("failed") and needle in res["msg"], (args.keys(), extra, res)
    assert not (state_root / "activation-runtime").exists()


def test_activation_runtime_check_mode_sees_stray_bytecode_in_a_staged_runtime(state_root):
    """Bytecode the digest does not cover (Python would load it instead of the sources) makes a real
    run re-stage; check mode says so too instead of calling the runtime staged."""
    src = collection_root() / "ansible_collections" / "coldsnap" / "fleet" / "runtime_image" / "activation"
    args = {"src": str(src), "state_root": str(state_root)}
    first = run_module("activation_runtime", args)
    assert first["changed"] and first["staged"]
    planted = Path(first["path"]) / "coldsnap_activation" / "__pycache__"
    planted.mkdir()
    (planted / "sequence.cpython-311.pyc").write_bytes(b"not the staged source")
    check = run_module("activation_runtime", args, "--check")
    assert (check["changed"], check["staged"]) == (True, False), check
    assert planted.exists()  # check mode removed nothing
    assert run_module("activation_runtime", args)["changed"] is True and not planted.exists()
    assert run_module("activation_runtime", args, "--check")["changed"] is False


def test_artifact_commit_check_mode_answers_as_the_commit_and_the_promotion_would(state_root, tmp_path):
    """Check mode writes nothing and reports what the run would: unchanged for the committed
    descriptor, changed while it is not yet promoted, the same refusal for a conflicting one."""
    from ansible_collections.coldsnap.fleet.plugins.module_utils.artifacts.commit import commit_artifact

    req = make_request()
    art = make_artifact(req, capture_id="cap-1")
    out = tmp_path / "out"
    path, changed = commit_artifact(out, art, check_mode=True)
    assert changed and not path.exists() and not out.exists()
    path, changed = commit_artifact(out, art)
    assert changed and path.exists()
    assert commit_artifact(out, art, check_mode=True) == (path, False)
    other = make_artifact(req, capture_id="cap-2")
    with pytest.raises(Exception, match="capture never replaces an artifact"):
        commit_artifact(out, other, check_mode=True)
