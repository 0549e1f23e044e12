"""Launch-unit policy as data: capabilities from the bounding set, names, labels, mounts, ownership."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import ColdSnapError
from ansible_collections.coldsnap.fleet.plugins.module_utils.units import containers as du
from ansible_collections.coldsnap.fleet.plugins.module_utils.units import ownership


def _status(tmp_path: Path, capbnd: str) -> str:
    p = tmp_path / "status"
    p.write_text(f"Name:\tx\nCapInh:\t0000000000000000\nCapBnd:\t{capbnd}\n")
    return str(p)


def test_capability_policy_drops_exactly_what_the_host_lacks(tmp_path: Path) -> None:
    # The VM measured in DESIGN.md section 6: every capability but CAP_SYS_RESOURCE (bit 24).
    policy = du.capability_policy(_status(tmp_path, "000001fffeffffff"))
    assert policy["cap_add"] == ["ALL"] and policy["cap_drop"] == ["SYS_RESOURCE"]
    assert policy["privileged"] is False
    assert policy["security_opt"] == ["seccomp=unconfined", "apparmor=unconfined", "systempaths=unconfined"]
    full = du.capability_policy(_status(tmp_path, "000001ffffffffff"))
    assert full["cap_drop"] == []
    kwargs = du.docker_kwargs(policy)
    assert kwargs == {"privileged": False, "cap_add": ["ALL"], "cap_drop": ["SYS_RESOURCE"],
                      "security_opt": ["seccomp=unconfined", "apparmor=unconfined"], "unmask_system_paths": True}
    assert du.docker_kwargs(du.privileged_policy()) == {"privileged": True}


def test_this_hosts_bounding_set_is_readable() -> None:
    caps = du.bounding_capabilities()
    assert "CHOWN" in caps and caps <= set(du.CAP_NAMES)


def test_canonical_names_and_labels() -> None:
    assert du.canonical_container_name("reference-tiny-local", "unit-0") == "coldsnap-reference-tiny-local-unit-0"
    assert du.canonical_container_name("my recipe/v2", "u:1") == "coldsnap-my-recipe-v2-u-1"
    labels = du.unit_labels(capture_id="cap-1", unit="unit-0", operation_id="op-1", recipe="r", log_path="/l/x.log")
    assert labels == {"org.coldsnap.capture-id": "cap-1", "org.coldsnap.unit": "unit-0",
                      "org.coldsnap.operation-id": "op-1", "org.coldsnap.recipe": "r", "org.coldsnap.role": "rank",
                      "org.coldsnap.log-path": "/l/x.log"}


def test_activation_mount_is_content_addressed_and_read_only() -> None:
    digest = "sha256:" + "ab" * 32
    m = du.activation_mount("/var/lib/coldsnap", digest)
    assert m == {"source": "/var/lib/coldsnap/activation-runtime/sha256/" + "ab" * 32,
                 "target": du.ACTIVATION_TARGET, "read_only": True, "kind": "activation"}
    with pytest.raises(ColdSnapError):
        du.activation_mount("/var/lib/coldsnap", "sha256:../../etc")


def test_mount_policy(tmp_path: Path) -> None:
    pytest.importorskip("docker")
    src = str(tmp_path)
    mounts = du.docker_mounts([{"source": src, "target": "/models/m", "kind": "model"},
                               {"source": src, "target": "/state", "read_only": False, "kind": "state"}])
    assert [m["ReadOnly"] for m in mounts] == [True, False]
    with pytest.raises(ColdSnapError, match="must be read-only"):
        du.docker_mounts([{"source": src, "target": "/models/m", "read_only": False, "kind": "model"}])
    with pytest.raises(ColdSnapError, match="must be read-only"):
        du.docker_mounts([{"source": src, "target": "/a", "read_only": False, "kind": "activation"}])
    with pytest.raises(ColdSnapError, match="appears twice"):
        du.docker_mounts([{"source": src, "target": "/x"}, {"source": src, "target": "/x"}])
    with pytest.raises(ColdSnapError, match="does not exist"):
        du.docker_mounts([{"source": src + "/missing", "target": "/x"}])
    with pytest.raises(ColdSnapError, match="absolute"):
        du.docker_mounts([{"source": "rel", "target": "/x"}])


@pytest.mark.skipif(os.geteuid() != 0, reason="changing file owners needs root")
def test_in_process_ownership_keeps_mode_bits_and_is_idempotent(tmp_path: Path) -> None:
    state = tmp_path / "state"
    (state / "img").mkdir(parents=True)
    (state / "img" / "pages.img").write_bytes(b"x")
    (state / "suid").write_bytes(b"#!")
    os.chmod(state / "suid", 0o6755)
    os.chmod(state / "img", 0o2750)
    (state / "link").symlink_to("/etc/passwd")  # must be changed itself, never followed
    passwd_owner = os.stat("/etc/passwd").st_uid
    res = ownership.chown_state_paths([state], 4242, 4343, method="in-process")
    assert res["method"] == "in-process" and res["changed"] == 5
    for p in [state, state / "img", state / "img" / "pages.img", state / "suid", state / "link"]:
        st = os.lstat(p)
        assert (st.st_uid, st.st_gid) == (4242, 4343), p
    assert stat.S_IMODE(os.stat(state / "suid").st_mode) == 0o6755
    assert stat.S_IMODE(os.stat(state / "img").st_mode) == 0o2750
    assert os.stat("/etc/passwd").st_uid == passwd_owner
    assert ownership.chown_state_paths([state], 4242, 4343, method="in-process")["changed"] == 0


def test_ownership_refuses_system_paths_and_symlinks(tmp_path: Path) -> None:
    for bad in ("/", "/etc", "/var", "relative"):
        with pytest.raises(ColdSnapError, match="not a dedicated"):
            ownership.chown_state_paths([Path(bad)], 1000, 1000)
    (tmp_path / "l").symlink_to(tmp_path)
    with pytest.raises(ColdSnapError, match="symlink"):
        ownership.chown_state_paths([tmp_path / "l"], 1000, 1000)
    with pytest.raises(ColdSnapError, match="numeric"):
        ownership.chown_state_paths([tmp_path], -1, 0)
    assert ownership.chown_state_paths([tmp_path / "missing"], 1000, 1000) == {"method": "none", "changed": 0, "paths": []}


def test_handing_over_never_follows_a_link_the_user_planted_above_or_inside_the_state(tmp_path):
    """A state path below a link the invoking user made (``workloads -> /``) is refused; inside the tree
    links are changed themselves, never what they point at, and the walk does not descend into them."""
    import os
    import stat

    from ansible_collections.coldsnap.fleet.plugins.module_utils.units import ownership

    if os.geteuid() != 0:
        pytest.skip("changing owners needs root")
    victim = tmp_path / "etc"
    victim.mkdir()
    (victim / "shadow").write_text("root only")
    state = tmp_path / "state"
    state.mkdir()
    (state / "workloads").symlink_to(tmp_path)
    os.lchown(state / "workloads", 4242, 4242)  # the user's link
    with pytest.raises(ColdSnapError, match="not root's"):
        ownership.chown_state_paths([state / "workloads" / "etc"], 4242, 4343, method="in-process")
    tree = tmp_path / "tree"
    (tree / "sub").mkdir(parents=True)
    (tree / "sub" / "to-etc").symlink_to(victim)
    (tree / "setgid").write_text("x")
    os.chmod(tree / "setgid", 0o2750)
    res = ownership.chown_state_paths([tree], 4242, 4343, method="in-process")
    assert res["changed"] == 4  # tree, sub, the link itself, setgid
    assert os.stat(victim / "shadow").st_uid == 0 and os.stat(victim).st_uid == 0
    assert os.lstat(tree / "sub" / "to-etc").st_uid == 4242
    assert stat.S_IMODE(os.stat(tree / "setgid").st_mode) == 0o2750 and os.stat(tree / "setgid").st_gid == 4343
