"""The peer transfer: a real server on loopback and the real client, as the roles use them."""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import json
import os
import re
import socket
import stat
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import (
    ColdSnapError,
    IntegrityError,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.cache import NodeCache
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.layout import PackRef
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.provider import resolve_provider
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.stage import (
    StageSource,
    peer_partial,
    stage_payload,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.verifier import PayloadVerifier
from ansible_collections.coldsnap.fleet.plugins.module_utils.transfer import auth
from ansible_collections.coldsnap.fleet.plugins.module_utils.transfer.client import (
    Peer,
    PeerUnreachable,
    fetch_file,
    fetch_tree,
    partial_path,
    plan_tree,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.transfer.server import (
    PeerServer,
    bind,
    file_table,
    run_file_for,
    serve,
    start_server,
    stop_server,
)
from module_runner import HAVE_ANSIBLE, run_module
from netports import free_port
from slow_servers import header_trickler

TOKEN = "t" * 40


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def tree(tmp_path):
    root = tmp_path / "layout"
    blob = os.urandom(3 << 20) + b"tail"
    (root / "blobs" / "sha256").mkdir(parents=True)
    (root / "blobs" / "sha256" / sha(blob)).write_bytes(blob)
    (root / "index.json").write_text('{"schemaVersion": 2}')
    (root / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    return root, blob


def run_server(root: Path, include=None, token: str = TOKEN):
    server = PeerServer(bind("127.0.0.1", 0), file_table(root, include), token)
    thread = threading.Thread(target=serve, args=(server,), kwargs={"idle_timeout": 60, "lifetime": 600},
                              daemon=True)
    thread.start()
    return server


@pytest.fixture
def served(tree):
    server = run_server(tree[0])
    yield server, tree
    server.shutdown()


def peer_of(server: PeerServer, token: str = TOKEN, **kw) -> Peer:
    return Peer(server.server_address[0], server.server_address[1], token, **kw)


def test_a_tree_arrives_identical_and_a_second_pull_moves_nothing(served, tmp_path):
    server, (root, blob) = served
    dest = tmp_path / "dest"
    seen = []
    out = fetch_tree(peer_of(server), dest, progress=lambda d, t: seen.append((d, t)))
    assert sorted(out["fetched"]) == sorted(["index.json", "oci-layout", f"blobs/sha256/{sha(blob)}"])
    for f in root.rglob("*"):
        if f.is_file():
            assert (dest / f.relative_to(root)).read_bytes() == f.read_bytes()
    assert seen and seen[-1][0] == seen[-1][1] == out["bytes"]
    # private like everything under the state root: files 0600, directories 0700
    assert {stat.S_IMODE(p.stat().st_mode) for p in dest.rglob("*") if p.is_file()} == {0o600}
    assert {stat.S_IMODE(p.stat().st_mode) for p in [dest, *dest.rglob("*")] if p.is_dir()} == {0o700}
    assert not list(dest.rglob("*.peer-partial"))
    again = fetch_tree(peer_of(server), dest)
    assert again["fetched"] == [] and again["bytes_received"] == 0


def test_a_pull_into_a_directory_with_other_files_keeps_them(served, tmp_path):
    """What ``dest`` held besides the served files survives the swap (and so does its mode); a stale copy of
    a served file is replaced."""
    server, (root, _blob) = served
    dest = tmp_path / "keepme"
    (dest / "notes").mkdir(parents=True)
    os.chmod(dest, 0o750)
    (dest / "mydata.txt").write_text("important")
    (dest / "notes" / "n.txt").write_text("also")
    os.symlink("mydata.txt", dest / "alias")
    (dest / "index.json").write_text("stale")
    out = fetch_tree(peer_of(server), dest)
    assert sorted(out["kept"]) == ["alias", "mydata.txt", "notes/n.txt"]
    assert (dest / "mydata.txt").read_text() == "important" and (dest / "notes" / "n.txt").read_text() == "also"
    assert os.readlink(dest / "alias") == "mydata.txt"
    assert (dest / "index.json").read_bytes() == (root / "index.json").read_bytes()
    assert stat.S_IMODE(dest.stat().st_mode) == 0o750
    assert not list(tmp_path.glob(".keepme*"))


def test_a_file_where_the_served_tree_needs_a_directory_is_refused_before_the_swap(served, tmp_path):
    server, _tree = served
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / "blobs").write_text("a file where blobs/ goes")
    with pytest.raises(ColdSnapError, match="cannot be kept"):
        fetch_tree(peer_of(server), dest)
    assert (dest / "blobs").read_text() == "a file where blobs/ goes"


def test_a_wrong_token_is_refused_and_names_no_secret(served, tmp_path):
    server, _tree = served
    with pytest.raises(ColdSnapError, match="authentication failed") as err:
        fetch_tree(peer_of(server, "w" * 40), tmp_path / "dest")
    assert "w" * 40 not in str(err.value) and TOKEN not in str(err.value)
    assert not (tmp_path / "dest").exists()


def _raw_get(server: PeerServer, path: str, headers: dict) -> int:
    conn = http.client.HTTPConnection(*server.server_address, timeout=10)
    try:
        conn.request("GET", path, headers=headers)
        resp = conn.getresponse()
        resp.read()
        return resp.status
    finally:
        conn.close()


def test_a_replayed_request_and_an_unsigned_one_are_refused(served):
    server, _tree = served
    headers = auth.request_headers(TOKEN, "GET", "/v1/files")
    assert _raw_get(server, "/v1/files", headers) == 200
    assert _raw_get(server, "/v1/files", headers) == 403  # the same nonce twice
    assert _raw_get(server, "/v1/files", {}) == 403
    # a signature binds the path: signed for the listing, used for a file
    other = auth.request_headers(TOKEN, "GET", "/v1/files")
    assert _raw_get(server, "/v1/files/index.json", other) == 403


def test_only_the_table_is_served_never_a_path_outside_it(tree, tmp_path):
    root, _blob = tree
    secret = tmp_path / "secret"
    secret.write_text("root's secret")
    os.symlink(secret, root / "link")
    server = run_server(root)
    try:
        names = [f["name"] for f in peer_of(server).listing()]
        assert "link" not in names
        for path in ("/v1/files/link", "/v1/files/../secret", "/v1/files/%2E%2E/secret", "/etc/passwd"):
            assert _raw_get(server, path, auth.request_headers(TOKEN, "GET", path)) == 404
    finally:
        server.shutdown()


def test_a_partial_prefix_is_continued_and_a_wrong_one_is_fetched_again(served, tmp_path):
    server, (_root, blob) = served
    name = f"blobs/sha256/{sha(blob)}"
    partial = tmp_path / "x.peer-partial"
    partial.write_bytes(blob[:1 << 20])
    got = fetch_file(peer_of(server), name, partial, size=len(blob), sha256=sha(blob))
    assert got.resumed_from == 1 << 20 and got.bytes_received == len(blob) - (1 << 20)
    assert partial.read_bytes() == blob
    partial.write_bytes(b"\0" * 1000)  # not a prefix of the file
    got = fetch_file(peer_of(server), name, partial, size=len(blob), sha256=sha(blob))
    assert got.bytes_received == len(blob) and partial.read_bytes() == blob


def test_a_file_that_is_not_what_the_receiver_expects_is_thrown_away(served, tmp_path):
    server, (_root, blob) = served
    partial = tmp_path / "x.peer-partial"
    with pytest.raises(IntegrityError, match="hashes to"):
        fetch_file(peer_of(server), "index.json", partial, size=None, sha256="0" * 64)
    assert not partial.exists()
    with pytest.raises(IntegrityError, match=f"offered {len(blob)} bytes .* the file has {len(blob) + 1}"):
        fetch_file(peer_of(server), f"blobs/sha256/{sha(blob)}", partial, size=len(blob) + 1, sha256=sha(blob))
    assert not partial.exists()


class CuttingProxy:
    """A real TCP proxy that cuts the first connection after ``cut`` bytes from the server."""

    def __init__(self, target: tuple[str, int], cut: int) -> None:
        self.target, self.cut, self.connections = target, cut, 0
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _addr = self.listener.accept()
            except OSError:
                return
            self.connections += 1
            limit = self.cut if self.connections == 1 else None
            threading.Thread(target=self._pipe, args=(client, limit), daemon=True).start()

    def _pipe(self, client: socket.socket, limit: int | None) -> None:
        upstream = socket.create_connection(self.target)
        threading.Thread(target=self._copy, args=(client, upstream, None), daemon=True).start()
        self._copy(upstream, client, limit)

    @staticmethod
    def _copy(src: socket.socket, dst: socket.socket, limit: int | None) -> None:
        sent = 0
        try:
            while data := src.recv(65536):
                if limit is not None and sent + len(data) >= limit:
                    dst.sendall(data[:limit - sent])
                    break
                dst.sendall(data)
                sent += len(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()


def test_a_dropped_connection_resumes_where_it_stopped(served, tmp_path):
    server, (_root, blob) = served
    proxy = CuttingProxy(server.server_address, cut=(1 << 20) + 300)
    peer = Peer("127.0.0.1", proxy.port, TOKEN, timeout=10)
    got = fetch_file(peer, f"blobs/sha256/{sha(blob)}", tmp_path / "p", size=len(blob), sha256=sha(blob))
    assert proxy.connections == 2, "the transfer should have needed a second connection"
    assert got.bytes_received == len(blob) and (tmp_path / "p").read_bytes() == blob
    assert server.bytes_sent < 2 * len(blob)  # the second response started after what had arrived


def test_the_detached_server_binds_one_address_records_itself_privately_and_stops(tree, tmp_path):
    root, _blob = tree
    run_file = tmp_path / "runs" / "t.json"
    out = start_server(root, token=TOKEN, address="127.0.0.1", run_file=run_file, idle_timeout=60)
    try:
        assert out["address"] == "127.0.0.1" and out["files"] == 3
        assert stat.S_IMODE(run_file.stat().st_mode) == 0o600
        assert TOKEN not in run_file.read_text() and TOKEN not in run_file.with_suffix(".log").read_text()
        assert json.loads(run_file.read_text())["pid"] == out["pid"]
        listed = Peer("127.0.0.1", out["port"], TOKEN).listing()
        assert {f["name"] for f in listed} >= {"index.json", "oci-layout"}
        with pytest.raises(ColdSnapError, match="cannot listen"):  # the port is held
            start_server(root, token=TOKEN, address="127.0.0.1", port=out["port"], run_file=tmp_path / "other.json")
        # check mode says it would stop the server, and signals and removes nothing
        assert stop_server(run_file, check_mode=True) is True
        assert run_file.exists() and Peer("127.0.0.1", out["port"], TOKEN).listing()
    finally:
        assert stop_server(run_file) is True
    assert not run_file.exists()
    assert stop_server(run_file, check_mode=True) is False
    assert not Path(f"/proc/{out['pid']}").exists() or "Z" in Path(f"/proc/{out['pid']}/stat").read_text().split()[2]
    assert stop_server(run_file) is False  # idempotent


def test_starting_the_same_transfer_again_keeps_its_server(tree, tmp_path):
    root, _blob = tree
    run_file = tmp_path / "runs" / "same.json"
    first = start_server(root, token=TOKEN, address="127.0.0.1", run_file=run_file, idle_timeout=60)
    try:
        assert first["changed"]
        for check_mode in (True, False):
            again = start_server(root, token=TOKEN, address="127.0.0.1", run_file=run_file, idle_timeout=60,
                                 check_mode=check_mode)
            assert not again["changed"] and (again["pid"], again["port"]) == (first["pid"], first["port"])
        assert TOKEN not in run_file.read_text()
        # Another token, or a served file that changed, is another server.
        other = start_server(root, token=TOKEN + "x", address="127.0.0.1", run_file=run_file, idle_timeout=60,
                             check_mode=True)
        assert other["changed"] and other["pid"] is None
        (root / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}  ')
        replaced = start_server(root, token=TOKEN, address="127.0.0.1", run_file=run_file, idle_timeout=60)
        assert replaced["changed"] and replaced["pid"] != first["pid"]
        assert not Path(f"/proc/{first['pid']}").exists() or \
            "Z" in Path(f"/proc/{first['pid']}/stat").read_text().split()[2]
    finally:
        stop_server(run_file)


def test_a_refused_address_or_port_keeps_the_running_server_and_check_mode_refuses_it_too(tree, tmp_path):
    root, _blob = tree
    run_file = tmp_path / "runs" / "kept.json"
    first = start_server(root, token=TOKEN, address="127.0.0.1", run_file=run_file, idle_timeout=60)
    try:
        for check_mode in (True, False):
            for address, port, message in (("0.0.0.0", 0, "every interface"), ("nohost.invalid", 0, "does not resolve"),
                                           ("127.0.0.1", 99999, "not 0..65535")):
                with pytest.raises(ColdSnapError, match=message):
                    start_server(root, token=TOKEN, address=address, port=port, run_file=run_file, idle_timeout=60,
                                 check_mode=check_mode)
        assert Path(f"/proc/{first['pid']}").exists() and run_file.exists()  # still serving
        again = start_server(root, token=TOKEN, address="127.0.0.1", run_file=run_file, idle_timeout=60)
        assert not again["changed"] and again["pid"] == first["pid"]
    finally:
        stop_server(run_file)


def test_a_kept_server_starts_its_idle_clock_again(tree, tmp_path):
    run_file = tmp_path / "kept.json"
    first = start_server(tree[0], token=TOKEN, address="127.0.0.1", run_file=run_file, idle_timeout=3)
    try:
        time.sleep(2)
        again = start_server(tree[0], token=TOKEN, address="127.0.0.1", run_file=run_file, idle_timeout=3)
        assert not again["changed"] and again["pid"] == first["pid"]
        time.sleep(2)  # 4 s after its start, 2 s after it was kept: still serving
        assert Peer("127.0.0.1", first["port"], TOKEN).listing()
    finally:
        stop_server(run_file)


def test_an_idle_server_stops_by_itself(tree, tmp_path):
    out = start_server(tree[0], token=TOKEN, address="127.0.0.1", run_file=tmp_path / "i.json", idle_timeout=1)
    deadline = time.monotonic() + 20
    while Path(f"/proc/{out['pid']}").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not Path(f"/proc/{out['pid']}").exists()
    assert "idle for 1 s" in (tmp_path / "i.log").read_text()


def test_bad_server_options_are_named(tree, tmp_path):
    with pytest.raises(ColdSnapError, match="at least 32"):
        start_server(tree[0], token="short", address="127.0.0.1", run_file=tmp_path / "r.json")
    with pytest.raises(ColdSnapError, match="not a plain relative path"):
        file_table(tree[0], ["../etc/passwd"])
    with pytest.raises(ColdSnapError, match="does not exist"):
        file_table(tree[0], ["missing.pack"])
    with pytest.raises(ColdSnapError, match=r"cannot listen on 192\.0\.2\.1"):
        bind("192.0.2.1", 0)  # TEST-NET: never an address of this host
    for wildcard in ("0.0.0.0", "::", "::ffff:0.0.0.0"):  # the last one: every IPv4 interface, spelled in IPv6
        with pytest.raises(ColdSnapError, match="means every interface"):
            bind(wildcard, 0)
    assert TOKEN not in repr(Peer("127.0.0.1", 1, TOKEN))


def test_bad_transfer_names_timeouts_and_endpoints_are_named(tree, tmp_path):
    assert run_file_for(tmp_path, "restore-1-payload-worker-0-to-gpu_b") == \
        tmp_path / "runs" / "transfers" / "restore-1-payload-worker-0-to-gpu_b.json"
    for bad in ("../../etc/x", "", ".hidden", "a/b", "x" * 300):
        with pytest.raises(ColdSnapError, match="transfer name"):
            run_file_for(tmp_path, bad)
    for key in ("idle_timeout", "lifetime"):
        for bad in (0, -1, float("nan"), float("inf")):  # NaN would never time out: a server for ever
            with pytest.raises(ColdSnapError, match=f"{key} {bad!r} is not a finite number of seconds > 0"):
                start_server(tree[0], token=TOKEN, address="127.0.0.1", run_file=tmp_path / "r.json", **{key: bad})
    assert not (tmp_path / "r.json").exists()
    for address, port in (("127.0.0.1", 0), ("127.0.0.1", 70000), ("", 80), ("127.0.0.1", True)):
        with pytest.raises(ColdSnapError, match="is not an address and a port"):
            Peer(address, port, TOKEN)


def test_a_payload_is_staged_from_a_peer_into_the_node_cache(tmp_path):
    data = os.urandom(2 << 20)
    hexd = sha(data)
    src = tmp_path / "src"
    src.mkdir()
    (src / f"{hexd}.pack").write_bytes(data)
    server = run_server(src, [f"{hexd}.pack"])
    try:
        source = StageSource.from_dict({"kind": "peer", "address": "127.0.0.1", "port": server.server_address[1],
                                        "token": TOKEN})
        assert TOKEN not in repr(source) and TOKEN not in source.describe()
        cache = NodeCache(tmp_path / "state")
        cache.ensure_dirs()
        cache.downloads.mkdir(exist_ok=True)
        peer_partial(cache, hexd).write_bytes(data[:12345])  # an earlier run stopped here
        result = stage_payload(tmp_path / "state", f"sha256:{hexd}", len(data), source)
        assert result.changed and result.bytes_copied == len(data) - 12345
        assert result.path.read_bytes() == data and stat.S_IMODE(result.path.stat().st_mode) == 0o400
        assert not peer_partial(cache, hexd).exists()
        again = stage_payload(tmp_path / "state", f"sha256:{hexd}", len(data), source)
        assert not again.changed and again.bytes_copied == 0
    finally:
        server.shutdown()
    with pytest.raises(ColdSnapError, match="'address', 'port'"):
        StageSource.from_dict({"kind": "peer", "address": "127.0.0.1", "token": TOKEN})
    with pytest.raises(ColdSnapError, match=r"'port' \(1\.\.65535\)"):  # 0 is a listener's ephemeral port, never a peer's
        StageSource.from_dict({"kind": "peer", "address": "127.0.0.1", "port": 0, "token": TOKEN})


def _payload_server(tmp_path, data: bytes, *, listed: bytes | None = None):
    """A transfer server that serves ``listed`` (default: ``data``) as the pack of ``data``'s digest."""
    src = tmp_path / "src"
    src.mkdir()
    (src / f"{sha(data)}.pack").write_bytes(data if listed is None else listed)
    return run_server(src, [f"{sha(data)}.pack"])


def _peer_source(port: int, token: str = TOKEN, *, check_mode: bool = False, **kw) -> StageSource:
    return StageSource.from_dict({"kind": "peer", "address": "127.0.0.1", "port": port, "token": token, **kw},
                                 check_mode=check_mode)


def test_check_mode_asks_the_peer_and_fails_as_the_real_run_would(tmp_path):
    """Check mode asks the transfer server for its listing (no payload byte, nothing written here): a wrong
    token, a file it does not serve, another size, a server that is gone fail as the real run does."""
    data = os.urandom(1 << 20)
    digest, state = f"sha256:{sha(data)}", tmp_path / "state"
    server = _payload_server(tmp_path, data)
    port = server.server_address[1]
    try:
        ok = stage_payload(state, digest, len(data), _peer_source(port), check_mode=True)
        assert ok.changed and ok.bytes_copied == 0
        cases = [(_peer_source(port, "w" * 40), len(data), "refused the transfer"),
                 (_peer_source(port, filename="other.pack"), len(data), "does not serve other.pack"),
                 (_peer_source(port), len(data) + 1, f"with {len(data)} bytes; {digest} has {len(data) + 1}")]
        for source, size, says in cases:
            with pytest.raises(ColdSnapError, match=re.escape(says)):
                stage_payload(state, digest, size, source, check_mode=True)
        assert not state.exists(), "check mode wrote nothing"
        with pytest.raises(ColdSnapError, match="refused the transfer"):
            stage_payload(state, digest, len(data), _peer_source(port, "w" * 40))  # the real run says the same
        assert not peer_partial(NodeCache(state), sha(data)).exists(), "a refused pull keeps no empty partial"
    finally:
        server.shutdown()
        server.server_close()
    with pytest.raises(PeerUnreachable, match="cannot reach"):
        stage_payload(tmp_path / "s2", digest, len(data), _peer_source(port), check_mode=True)
    assert not (tmp_path / "s2").exists()


def test_a_peer_partial_goes_once_the_payload_is_staged_from_elsewhere_never_under_a_held_lock(tmp_path):
    data = os.urandom(1 << 20)
    digest, state = f"sha256:{sha(data)}", tmp_path / "state"
    local = tmp_path / "local.pack"
    local.write_bytes(data)
    cache = NodeCache(state)
    cache.ensure_dirs()
    cache.downloads.mkdir()
    partial = peer_partial(cache, sha(data))
    partial.write_bytes(data[:4096])  # an interrupted pull from the capture host
    with cache.lock(digest), pytest.raises(ColdSnapError, match="another worker"):
        stage_payload(state, digest, len(data), StageSource("local", path=local), lock_timeout=0)
    assert partial.exists(), "a partial is never removed while another stage holds the digest"
    assert stage_payload(state, digest, len(data), StageSource("local", path=local)).changed
    assert not partial.exists(), "staged from a later source: the peer's bytes are not kept"
    partial.write_bytes(data[:4096])
    gone = _peer_source(free_port())  # the cache already has it: the peer is never asked
    again = stage_payload(state, digest, len(data), gone)
    assert not again.changed and not partial.exists()
    partial.write_bytes(data[:4096])
    PayloadVerifier().verify(cache, digest, len(data)).close()  # the role's first look finds it in the cache
    assert not partial.exists()


def test_when_every_source_fails_each_failure_is_named_with_its_own_fix(tmp_path):
    data = os.urandom(1 << 20)
    digest = f"sha256:{sha(data)}"
    liar = _payload_server(tmp_path, data, listed=os.urandom(len(data)))  # the right size, other bytes
    port = liar.server_address[1]
    try:
        with pytest.raises(ColdSnapError) as err:
            resolve_provider("native", state_root=tmp_path / "state", pack=PackRef.for_digest(digest, len(data)),
                             recovery_enabled=False,
                             sources=[StageSource("local", path=tmp_path / "nowhere.pack"),
                                      _peer_source(port, "w" * 40), _peer_source(port)])
    finally:
        liar.shutdown()
    msg = str(err.value)
    served = (tmp_path / "src" / f"{sha(data)}.pack").read_bytes()
    assert f"{tmp_path / 'nowhere.pack'} does not exist (fix: give the path of the pack on this host)" in msg
    assert "refused the transfer (authentication failed) (fix: the server was started for another transfer" in msg
    assert f"hashes to sha256:{sha(served)}" in msg and "(fix: the source host's copy is corrupt" in msg
    assert f"peer 127.0.0.1:{port}: peer" not in msg  # each source named once
    cache = NodeCache(tmp_path / "state")
    assert not cache.path_for(digest).exists()
    assert not any(cache.downloads.iterdir()), "the other bytes are not kept for a resume"


def test_partial_names_stay_beside_the_final_name():
    assert partial_path(Path("/x/blobs/sha256/ab")) == Path("/x/blobs/sha256/.ab.peer-partial")


# ----------------------------------------------------------------------------- hostile ends

def test_a_pull_never_writes_through_a_link_and_never_leaves_half_a_tree(tree, tmp_path):
    """A link planted in the destination is not followed (the tree gathers in a private sibling that
    replaces it); a pull cut short leaves nothing under the final name, and the next run completes."""
    root, blob = tree
    outside = tmp_path / "outside"
    outside.mkdir()
    dest = tmp_path / "dest"
    (dest / "blobs").mkdir(parents=True)
    (dest / "blobs" / "sha256").symlink_to(outside)
    server = run_server(root)
    try:
        out = fetch_tree(peer_of(server), dest)
        assert sorted(out["fetched"]) == ["blobs/sha256/" + sha(blob), "index.json", "oci-layout"]
        assert os.listdir(outside) == [] and not (dest / "blobs" / "sha256").is_symlink()
        assert (dest / "blobs" / "sha256" / sha(blob)).read_bytes() == blob
    finally:
        server.shutdown()
    (root / "oci-layout").write_text('{"imageLayoutVersion": "9.9.9"}')  # changes under a new server's table
    server = run_server(root)
    (root / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}!')  # ... and again while it serves
    other = tmp_path / "other"
    try:
        with pytest.raises(ColdSnapError, match=r"409|changed"):
            fetch_tree(peer_of(server, attempts=1), other)
        assert not other.exists(), "nothing under the final name until every file is in"
    finally:
        server.shutdown()
    server = run_server(root)
    try:
        again = fetch_tree(peer_of(server), other)
        assert "oci-layout" in again["fetched"] and (other / "index.json").exists()
        assert "blobs/sha256/" + sha(blob) not in again["fetched"], "what arrived before is kept"
    finally:
        server.shutdown()


def test_an_answer_larger_than_the_listing_is_refused_unread(tmp_path):
    """Whoever answers at the server's address (the real one stopped on its idle timeout) cannot make
    the receiver write more than the file's listed size."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Liar(BaseHTTPRequestHandler):
        def log_message(self, *_a) -> None:
            pass

        def do_GET(self) -> None:
            if self.path == "/v1/files":
                body = json.dumps({"files": [{"name": "small.txt", "size": 10, "sha256": "0" * 64}]}).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                return
            self.send_response(200)
            self.send_header("Content-Length", str(64 << 20))
            self.end_headers()
            with contextlib.suppress(OSError):
                for _chunk in range(64):
                    self.wfile.write(b"A" * (1 << 20))

    liar = ThreadingHTTPServer(("127.0.0.1", 0), Liar)
    threading.Thread(target=liar.serve_forever, daemon=True).start()
    try:
        with pytest.raises(IntegrityError, match="offered 67108864 bytes"):
            fetch_tree(Peer("127.0.0.1", liar.server_address[1], TOKEN, attempts=1), tmp_path / "dest")
        assert sum(f.stat().st_size for f in tmp_path.rglob("*") if f.is_file()) == 0
    finally:
        liar.shutdown()


def test_the_server_serves_only_what_lies_below_its_root_and_lists_every_digest(tmp_path):
    root = tmp_path / "root"
    (root / "d").mkdir(parents=True)
    (root / "d" / "key").write_text("served")
    (root / "big.bin").write_bytes(b"\1" * ((16 << 20) + 1))  # not named by its digest, over 16 MiB
    secret = tmp_path / "secret"
    secret.mkdir()
    (secret / "key").write_text("SECRET")
    (root / "linked").symlink_to(secret)
    with pytest.raises(ColdSnapError, match="below the symbolic link"):
        file_table(root, ["linked/key"])
    table = file_table(root)
    assert sorted(table) == ["big.bin", "d/key"] and all(f.sha256 for f in table.values())
    server = run_server(root)
    try:
        (root / "d").rename(tmp_path / "moved")
        (root / "d").symlink_to(secret)  # the directory swapped for a link after the table was made
        with pytest.raises(ColdSnapError, match=r"409|changed"):
            fetch_file(peer_of(server, attempts=1), "d/key", tmp_path / "x.partial", size=6, sha256=None)
    finally:
        server.shutdown()
    for wildcard in ("0.0.0.0", "::"):
        with pytest.raises(ColdSnapError, match="every interface"):
            bind(wildcard, 0)


def test_a_mac_header_that_is_not_hex_is_refused_not_a_crash(served):
    server, _tree = served
    status = _raw_get(server, "/v1/files", {auth.NONCE_HEADER: "n" * 32, auth.MAC_HEADER: "é" * 64})
    assert status == 403


def test_plan_tree_names_what_a_pull_would_bring_and_writes_nothing(served, tmp_path):
    server, (_root, blob) = served
    dest = tmp_path / "dest"
    everything = sorted(["index.json", "oci-layout", f"blobs/sha256/{sha(blob)}"])
    first = plan_tree(peer_of(server), dest)
    assert first["changed"] and sorted(first["fetched"]) == everything and first["bytes_received"] == 0
    assert not dest.exists() and not list(tmp_path.glob(".dest*"))
    fetch_tree(peer_of(server), dest)
    assert plan_tree(peer_of(server), dest) == {**first, "changed": False, "fetched": []}
    (dest / "oci-layout").write_text('{"imageLayoutVersion": "9.9.9"}')  # same size, other bytes
    assert plan_tree(peer_of(server), dest)["fetched"] == ["oci-layout"]


@pytest.mark.skipif(not HAVE_ANSIBLE, reason="ansible-core is not installed in this environment")
def test_transfer_fetch_check_mode_asks_the_server_and_moves_nothing(served, tmp_path):
    server, (_root, blob) = served
    dest = tmp_path / "dest"
    args = {"dest": str(dest), "address": "127.0.0.1", "port": server.server_address[1], "token": TOKEN}
    out = run_module("transfer_fetch", args, "--check")
    assert out["changed"] and f"blobs/sha256/{sha(blob)}" in out["fetched"], out
    assert not dest.exists() and TOKEN not in json.dumps(out)
    fetched = run_module("transfer_fetch", args)
    assert fetched["changed"] and dest.is_dir()
    assert run_module("transfer_fetch", args, "--check")["changed"] is False
    # as in a check-mode play, where transfer_serve started no server (it reports port 0)
    idle = run_module("transfer_fetch", {**args, "port": 0}, "--check")
    assert idle["changed"] and "starts no server in check mode" in idle["msg"] and idle["fetched"] == []


def test_a_listing_cannot_pass_other_bytes_off_under_a_digest_name(tmp_path):
    """Whoever answers at the server's address lists blobs/sha256/<H> with the digest of its own bytes:
    the name is what the file must hash to, so nothing is written."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    real, evil = hashlib.sha256(b"the real layer").hexdigest(), b"other bytes"

    class Impostor(BaseHTTPRequestHandler):
        def log_message(self, *_a) -> None:
            pass

        def do_GET(self) -> None:
            body = json.dumps({"files": [{"name": f"blobs/sha256/{real}", "size": len(evil),
                                          "sha256": sha(evil)}]}).encode() if self.path == "/v1/files" else evil
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    impostor = ThreadingHTTPServer(("127.0.0.1", 0), Impostor)
    threading.Thread(target=impostor.serve_forever, daemon=True).start()
    try:
        peer = Peer("127.0.0.1", impostor.server_address[1], TOKEN, attempts=1)
        for call in (lambda: fetch_tree(peer, tmp_path / "dest"), lambda: plan_tree(peer, tmp_path / "dest")):
            with pytest.raises(IntegrityError, match="not the digest its name states"):
                call()
        assert not [f for f in tmp_path.rglob("*") if f.is_file()]
    finally:
        impostor.shutdown()


def test_only_authenticated_requests_keep_a_server_alive_and_ranges_stay_in_the_file(tree, tmp_path):
    out = start_server(tree[0], token=TOKEN, address="127.0.0.1", run_file=tmp_path / "a.json", idle_timeout=2)
    server = SimpleNamespace(server_address=("127.0.0.1", out["port"]))
    try:
        name = "index.json"
        path = f"/v1/files/{name}"
        size = (tree[0] / name).stat().st_size
        # a resume point at the end, or one with more digits than any size has: 416, not a crash
        for rng in (f"bytes={size}-", "bytes=" + "9" * 5000 + "-"):
            assert _raw_get(server, path, auth.request_headers(TOKEN, "GET", path, rng)) == 416
        assert _raw_get(server, path, auth.request_headers(TOKEN, "GET", path, "bytes=1-")) \
            == 206
        # unsigned requests (anyone who reaches the port) do not restart the idle clock
        deadline = time.monotonic() + 20
        while Path(f"/proc/{out['pid']}").exists() and time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                assert _raw_get(server, "/v1/files", {}) == 403
            time.sleep(0.3)
        assert not Path(f"/proc/{out['pid']}").exists(), "unauthenticated requests kept the server alive"
        assert "idle for 2 s" in (tmp_path / "a.log").read_text()
        assert "Traceback" not in (tmp_path / "a.log").read_text()
    finally:
        stop_server(tmp_path / "a.json")


@pytest.mark.skipif(not HAVE_ANSIBLE, reason="needs ansible-core")
def test_the_module_makes_a_missing_state_root_and_its_runs_private(tree, tmp_path):
    """A state root the transfer server is the first to write is 0700 like every other module's, and so is
    the directory its record lives in (they were left to the umask: 0755)."""
    root, _blob = tree
    state = tmp_path / "fresh" / "state"
    args = {"name": "t1", "root": str(root), "token": TOKEN, "address": "127.0.0.1", "state_root": str(state)}
    checked = run_module("transfer_serve", args, "--check")
    assert checked["changed"] and not state.exists()
    started = run_module("transfer_serve", args)
    try:
        assert started["changed"] and started["port"] > 0
        for directory in (state, state / "runs", state / "runs" / "transfers"):
            assert stat.S_IMODE(directory.stat().st_mode) == 0o700, directory
        assert TOKEN not in json.dumps(started)
    finally:
        assert run_module("transfer_serve", {**args, "state": "stopped"})["changed"]


def _liar(listing: bytes, *, stream_mib: int = 0):
    """A server at the transfer's address that answers ``listing`` and streams ``stream_mib`` MiB (no
    Content-Length) for any file; ``asked`` counts the file requests."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    asked = []

    class Liar(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"

        def log_message(self, *_a) -> None:
            pass

        def do_GET(self) -> None:
            if self.path == "/v1/files":
                self.send_response(200)
                self.send_header("Content-Length", str(len(listing)))
                self.end_headers()
                self.wfile.write(listing)
                return
            asked.append(self.path)
            self.send_response(200)
            self.end_headers()
            with contextlib.suppress(OSError):
                for _chunk in range(stream_mib):
                    self.wfile.write(b"A" * (1 << 20))

    liar = ThreadingHTTPServer(("127.0.0.1", 0), Liar)
    threading.Thread(target=liar.serve_forever, daemon=True).start()
    return liar, asked


@pytest.mark.parametrize("size", [-1, True, 1.5, "10"])
def test_a_listed_size_that_is_not_a_byte_count_is_refused_before_any_file_is_asked_for(tmp_path, size):
    """A negative size used to match a missing Content-Length (-1): the receiver then wrote whatever came
    until the peer hung up."""
    listing = json.dumps({"files": [{"name": "x.bin", "size": size, "sha256": "0" * 64}]}).encode()
    liar, asked = _liar(listing, stream_mib=16)
    try:
        peer = Peer("127.0.0.1", liar.server_address[1], TOKEN, attempts=1)
        for call in (lambda: fetch_tree(peer, tmp_path / "dest"), lambda: plan_tree(peer, tmp_path / "dest")):
            with pytest.raises(ColdSnapError, match="without its size and digest"):
                call()
        assert asked == []
        assert sum(f.stat().st_size for f in tmp_path.rglob("*") if f.is_file()) == 0
    finally:
        liar.shutdown()


@pytest.mark.parametrize("listing", [b"<html>not json</html>", b'{"files": 5}', b"[]", b'{"other": []}',
                                     b"[" * 100000])
def test_a_listing_that_is_not_a_list_of_files_is_named_not_a_crash(tmp_path, listing):
    liar, asked = _liar(listing)
    try:
        with pytest.raises(ColdSnapError, match="not a JSON list of files"):
            fetch_tree(Peer("127.0.0.1", liar.server_address[1], TOKEN, attempts=1), tmp_path / "dest")
        assert asked == [] and not (tmp_path / "dest").exists()
    finally:
        liar.shutdown()


def test_a_port_another_process_holds_keeps_the_running_server_of_the_transfer(tree, tmp_path):
    root, _blob = tree
    run_file = tmp_path / "runs" / "held.json"
    stranger = socket.socket()
    stranger.bind(("127.0.0.1", 0))
    stranger.listen(1)
    first = start_server(root, token=TOKEN, address="127.0.0.1", run_file=run_file, idle_timeout=60)
    try:
        with pytest.raises(ColdSnapError, match="Address already in use"):
            start_server(root, token=TOKEN, address="127.0.0.1", port=stranger.getsockname()[1], run_file=run_file,
                         idle_timeout=60)
        assert Path(f"/proc/{first['pid']}").exists() and run_file.exists()  # still serving
        assert Peer("127.0.0.1", first["port"], TOKEN, attempts=1).listing()
        # the server of the transfer itself holds the port asked for: it makes way for its replacement
        other = "o" * 40
        second = start_server(root, token=other, address="127.0.0.1", port=first["port"], run_file=run_file,
                              idle_timeout=60)
        assert second["changed"] and second["port"] == first["port"] and second["pid"] != first["pid"]
        assert Peer("127.0.0.1", second["port"], other, attempts=1).listing()
    finally:
        stranger.close()
        stop_server(run_file)


def test_completing_a_pull_cut_short_after_its_last_file_is_a_change(served, tmp_path):
    server, _tree = served
    dest = tmp_path / "dest"
    assert fetch_tree(peer_of(server), dest)["changed"] is True
    assert fetch_tree(peer_of(server), dest)["changed"] is False
    # every file arrived, then the run ended before the swap: the next run only renames
    dest.rename(dest.with_name(f".{dest.name}.peer-partial"))
    out = fetch_tree(peer_of(server), dest)
    assert out["fetched"] == [] and out["changed"] is True and dest.is_dir()


def test_the_server_log_escapes_what_a_client_sends(tree):
    logged: list[str] = []
    server = PeerServer(bind("127.0.0.1", 0), file_table(tree[0]), TOKEN, log=logged.append)
    thread = threading.Thread(target=serve, args=(server,), kwargs={"idle_timeout": 60, "lifetime": 600},
                              daemon=True)
    thread.start()
    try:
        with socket.create_connection(server.server_address, timeout=10) as s:
            s.sendall(b"GET /v1/files/\x1b[2J\x1b]0;owned\x07\rfake HTTP/1.1\r\nHost: x\r\n\r\n")
            s.recv(4096)
        deadline = time.monotonic() + 5
        while not logged and time.monotonic() < deadline:
            time.sleep(0.05)
        assert logged and not any(c in line for line in logged for c in "\x1b\x07\r"), logged
    finally:
        server.shutdown()


def test_the_detached_servers_log_is_never_written_through_a_link(tree, tmp_path):
    """A link planted at the server's log name (the run directory of a state root its user owns) would have
    the server append its log to whatever file it names."""
    root, _blob = tree
    run_file = tmp_path / "runs" / "linked.json"
    run_file.parent.mkdir(mode=0o700)
    victim = tmp_path / "victim"
    victim.write_bytes(b"untouched\n")
    victim.chmod(0o644)
    run_file.with_suffix(".log").symlink_to(victim)
    with pytest.raises(ColdSnapError, match="symbolic link"):
        start_server(root, token=TOKEN, address="127.0.0.1", run_file=run_file, idle_timeout=60)
    assert victim.read_bytes() == b"untouched\n" and stat.S_IMODE(victim.stat().st_mode) == 0o644
    assert not run_file.exists()


def test_check_mode_takes_the_port_transfer_serve_reports_when_it_starts_no_server(tmp_path):
    """In a check-mode play transfer_serve starts no server and the role hands payload_stage port 0: check
    mode reports that a real run would stage, asking nobody; a real run still refuses port 0."""
    data = os.urandom(4096)
    digest, state = f"sha256:{sha(data)}", tmp_path / "state"
    out = stage_payload(state, digest, len(data), _peer_source(0, check_mode=True), check_mode=True)
    assert out.changed and out.bytes_copied == 0
    assert not state.exists(), "check mode wrote nothing"
    with pytest.raises(ColdSnapError, match=re.escape("'port' (1..65535)")):
        _peer_source(0)
    with pytest.raises(ColdSnapError, match=re.escape("'port' (1..65535)")):
        stage_payload(state, digest, len(data), _peer_source(0, check_mode=True))


@pytest.mark.parametrize("length", ["abc", "1048576, 1048576", "0x100000"])
def test_a_content_length_that_is_not_a_byte_count_is_named_and_the_next_source_is_tried(tmp_path, length):
    """Whoever answers at a peer's address with a junk Content-Length made the stage fail with a bare
    ValueError: no source named, and the sources after the peer never tried."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    data = os.urandom(1 << 20)
    digest = f"sha256:{sha(data)}"

    class Junk(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"

        def log_message(self, *_a) -> None:
            pass

        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", length)
            self.end_headers()
            with contextlib.suppress(OSError):
                self.wfile.write(data)

    liar = ThreadingHTTPServer(("127.0.0.1", 0), Junk)
    threading.Thread(target=liar.serve_forever, daemon=True).start()
    local = tmp_path / "local.pack"
    local.write_bytes(data)
    port = liar.server_address[1]
    try:
        with pytest.raises(IntegrityError, match=rf"peer 127\.0\.0\.1:{port} answered for x\.pack with "
                                                 rf"Content-Length {re.escape(repr(length))}, not a byte count"):
            fetch_file(Peer("127.0.0.1", port, TOKEN, attempts=1), "x.pack", tmp_path / "x.partial",
                       size=len(data), sha256=sha(data))
        assert not (tmp_path / "x.partial").exists()
        provider = resolve_provider("native", state_root=tmp_path / "state",
                                    pack=PackRef.for_digest(digest, len(data)), recovery_enabled=False,
                                    sources=[_peer_source(port), StageSource("local", path=local)])
    finally:
        liar.shutdown()
    assert NodeCache(tmp_path / "state").path_for(digest).read_bytes() == data
    assert provider is not None


def test_a_served_name_with_a_nul_byte_is_named_not_a_crash(tree):
    """A NUL in an ``include`` name reached os.lstat and failed the module with a bare ValueError."""
    for name in ("a\x00b", f"{'0' * 64}.pack\x00../../etc/passwd"):
        with pytest.raises(ColdSnapError, match="is not a plain relative path"):
            file_table(tree[0], [name])


@pytest.mark.parametrize("entry", [{"name": "a\x00b", "size": 4, "sha256": "0" * 64},
                                   {"name": "a\udcffb", "size": 4, "sha256": "0" * 64},
                                   {"name": "ab", "size": 4, "sha256": "../../x"},
                                   {"name": "ab", "size": 4, "sha256": ["0" * 64]},
                                   {"name": "ab", "size": 4, "sha256": "A" * 64}])
def test_a_listed_name_or_digest_no_file_could_have_is_named_before_any_file_is_asked_for(tmp_path, entry):
    """A NUL or a lone surrogate in a listed name failed the pull with a bare ValueError or
    UnicodeEncodeError; a listed digest that is not 64 lower-case hex was taken as one."""
    liar, asked = _liar(json.dumps({"files": [entry]}).encode(), stream_mib=1)
    try:
        peer = Peer("127.0.0.1", liar.server_address[1], TOKEN, attempts=1)
        for call in (lambda: fetch_tree(peer, tmp_path / "dest"), lambda: plan_tree(peer, tmp_path / "dest")):
            with pytest.raises(ColdSnapError, match=r"not a plain relative path|not 64 lower-case hex digits"):
                call()
        assert asked == [] and not (tmp_path / "dest").exists()
    finally:
        liar.shutdown()


def test_a_peer_that_trickles_bytes_is_taken_as_stalled_and_what_came_is_kept(tmp_path):
    """The read timeout bounds each read only: whoever answers at a peer's address sending a byte now and
    then never reached it, and held the stage (and its per-digest lock) for as long as it kept sending."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    data = os.urandom(4096)
    stop = threading.Event()

    class Trickle(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"

        def log_message(self, *_a) -> None:
            pass

        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            with contextlib.suppress(OSError):
                for b in data:
                    if stop.wait(0.05):
                        return
                    self.wfile.write(bytes([b]))
                    self.wfile.flush()

    slow = ThreadingHTTPServer(("127.0.0.1", 0), Trickle)
    threading.Thread(target=slow.serve_forever, daemon=True).start()
    port = slow.server_address[1]
    partial = tmp_path / "x.partial"
    try:
        with pytest.raises(ColdSnapError, match=rf"peer 127\.0\.0\.1:{port}: x\.pack came too slowly: \d+ bytes in "
                                                r"[\d.]+ s, under the floor of 32 KiB a second \(a stalled") as err:
            fetch_file(Peer("127.0.0.1", port, TOKEN, timeout=1.0, attempts=1), "x.pack", partial,
                       size=len(data), sha256=sha(data))
    finally:
        stop.set()
        slow.shutdown()
    kept = partial.read_bytes()
    assert 0 < len(kept) < len(data) and kept == data[:len(kept)], "what came is kept for the next run"
    assert f"{len(kept)} bytes are kept in {partial}" in str(err.value)


def test_a_peer_that_trickles_its_headers_is_cut_off_at_the_deadline(tmp_path):
    """Whoever answers at a peer's address sending its response headers a byte at a time is cut off at twice
    the timeout (common.http_deadline), retried as a stalled peer, and named with what it did."""
    partial = tmp_path / "x.partial"
    with header_trickler() as port:
        with pytest.raises(ColdSnapError, match=rf"peer 127\.0\.0\.1:{port}: its status line and headers did not "
                                                r"all come within 1 s of the request \(a stalled or trickling "
                                                r"server\) failed after 2 attempts") as err:
            fetch_file(Peer("127.0.0.1", port, TOKEN, timeout=0.5, attempts=2), "x.pack", partial,
                       size=4, sha256=sha(b"abcd"))
    assert "stalled or trickling source" in err.value.fix, "the fix does not only say to make the host reachable"
    assert not partial.exists() or partial.stat().st_size == 0
