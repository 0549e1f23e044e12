"""Where a committed descriptor lands: directories made private whatever the umask, and what is already at
its name (a link, a named pipe) is never read through nor waited on."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
from ansible_collections.coldsnap.fleet.plugins.module_utils.artifacts.commit import commit_artifact
from ansible_collections.coldsnap.fleet.plugins.module_utils.artifacts.publication import commit_published
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import ColdSnapError
from lifecycle_helpers import make_artifact, make_request


def _in_thread(fn, timeout: float = 10.0):
    """Run ``fn`` with a deadline: a call that blocks (on a FIFO) fails the test instead of hanging it."""
    out: dict = {}

    def target() -> None:
        try:
            out["value"] = fn()
        except BaseException as exc:
            out["error"] = exc

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), "the commit blocked on what was at the descriptor's name"
    return out


def test_the_directories_a_commit_creates_are_private_whatever_the_umask(tmp_path):
    """``output.artifact_dir`` may lie outside the state root: under umask 000 its new directories were
    0777, so any user could replace the committed descriptor with one of theirs."""
    req = make_request()
    out = tmp_path / "new" / "deeper" / "out"
    old = os.umask(0)
    try:
        path, changed = commit_artifact(out, make_artifact(req, capture_id="cap-1"))
    finally:
        os.umask(old)
    assert changed
    for d in (tmp_path / "new", tmp_path / "new" / "deeper", out):
        assert d.stat().st_mode & 0o777 == 0o700, d
    assert path.stat().st_mode & 0o777 == 0o600


@pytest.mark.parametrize("commit", ["capture", "publish"])
def test_a_pipe_or_a_link_at_the_descriptors_name_is_refused_unread(tmp_path, commit):
    """A named pipe there hung the commit for ever; a link there was read through (as root: any file)."""
    req = make_request()
    art = make_artifact(req, capture_id="cap-1")
    out = tmp_path / "out"
    out.mkdir()
    final = out / "artifact.json"

    def run():
        if commit == "capture":
            return commit_artifact(out, art)
        return commit_published(out, art, source_path=tmp_path / "source.json")

    os.mkfifo(final)
    got = _in_thread(run)
    assert isinstance(got.get("error"), ColdSnapError), got
    assert final.is_fifo()
    final.unlink()
    # a link to the very same descriptor is still not read through (nor taken for a commit)
    elsewhere = tmp_path / "elsewhere.json"
    commit_artifact(tmp_path / "elsewhere", art)
    (tmp_path / "elsewhere" / "artifact.json").rename(elsewhere)
    final.symlink_to(elsewhere)
    got = _in_thread(run)
    assert isinstance(got.get("error"), ColdSnapError), got
    assert final.is_symlink() and Path(os.readlink(final)) == elsewhere
