"""Pre-restore checks that a captured process can come back here: its listening
ports and its pids must be free. Both fail before anything is evicted (at once, but
for a port held only by TIME_WAIT connections, which is waited for up to a minute, and
one that only outgoing connections hold or a pid that a process holds, each waited for a
few seconds): in prepare, and again in the evict step right before its kill
(:func:`require_restorable`)."""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path

from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import AdmissionError
from ansible_collections.coldsnap.fleet.plugins.module_utils.common.proctree import process_tree

TABLES = (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6))
LISTEN, TIME_WAIT = "0A", "06"


def tcp_rows(text: str) -> list[tuple[str, int, str, str]]:
    """(local address hex, local port, state hex, inode) of each socket in a /proc/net/tcp{,6} table."""
    rows = []
    for line in text.splitlines()[1:]:
        parts = line.split()
        if len(parts) > 9:
            addr_hex, port_hex = parts[1].rsplit(":", 1)
            rows.append((addr_hex, int(port_hex, 16), parts[3], parts[9]))
    return rows


def listeners_of(pid: int) -> list[tuple[str, int]]:
    """(address, port) of the TCP sockets ``pid`` listens on (IPv4 and IPv6)."""
    inodes = set()
    fd_dir = Path(f"/proc/{pid}/fd")
    for fd in fd_dir.iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    found = []
    for table, family in TABLES:
        with contextlib.suppress(OSError):
            for addr_hex, port, state, inode in tcp_rows(Path(f"/proc/{pid}/net/{table}").read_text()):
                if state == LISTEN and inode in inodes:
                    found.append((_decode_addr(addr_hex, family), port))
    return sorted(set(found))


def _decode_addr(hexaddr: str, family: int) -> str:
    raw = bytes.fromhex(hexaddr)
    if family == socket.AF_INET:
        return socket.inet_ntop(family, raw[::-1])
    words = [raw[i: i + 4][::-1] for i in range(0, 16, 4)]
    return socket.inet_ntop(family, b"".join(words))


def port_holder(port: int) -> str:
    """Best-effort 'pid N (comm)' of a process listening on ``port``."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            for _addr, p in listeners_of(int(proc.name)):
                if p == port:
                    comm = (proc / "comm").read_text().strip()
                    return f"pid {proc.name} ({comm})"
    return "another process"


def local_states(port: int, tables: dict[str, str] | None = None) -> list[str]:
    """TCP states (hex, as /proc/net/tcp writes them) of this host's sockets bound to ``port``."""
    states = []
    for name, _family in TABLES:
        text = (tables or {}).get(name)
        if text is None:
            try:
                text = Path(f"/proc/net/{name}").read_text()
            except OSError:
                continue
        states += [state for _addr, p, state, _inode in tcp_rows(text) if p == port]
    return states


def socket_owners() -> dict[str, set[int]]:
    """Socket inode -> pids holding it (every process of this host that we may inspect)."""
    owners: dict[str, set[int]] = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            for fd in (proc / "fd").iterdir():
                with contextlib.suppress(OSError):
                    target = os.readlink(fd)
                    if target.startswith("socket:["):
                        owners.setdefault(target[8:-1], set()).add(int(proc.name))
    return owners


def port_holders(port: int) -> set[int]:
    """Pids holding a TCP socket bound to ``port`` in any state but TIME_WAIT (which belongs to no one)."""
    inodes = set()
    for name, _family in TABLES:
        with contextlib.suppress(OSError):
            for _addr, p, state, inode in tcp_rows(Path(f"/proc/net/{name}").read_text()):
                if p == port and state != TIME_WAIT and inode != "0":
                    inodes.add(inode)
    if not inodes:
        return set()
    owners = socket_owners()
    return {pid for inode in inodes for pid in owners.get(inode, ())}


def _describe(pids: set[int]) -> str:
    out = []
    for pid in sorted(pids)[:4]:
        comm = "?"
        with contextlib.suppress(OSError):
            comm = Path(f"/proc/{pid}/comm").read_text().strip()
        out.append(f"pid {pid} ({comm})")
    return ", ".join(out) or "another process"


RESTORE_PORT_FIX = ("stop the process that holds the port, restore onto another port (set the unit's "
                    "launch.execution.services[].port and the command's --port: every listener of the unit moves "
                    "by the same shift), or onto a host where it is free (only the workload this restore replaces "
                    "may hold a captured port: it is evicted once prepare passed on every host)")
ADDRESS_FIX = ("restore onto an address of this host: set the unit's launch.execution.services[].address (and the "
               "command's --host) to it, or to 0.0.0.0")


def require_ports_free(listeners: list[tuple[str, int]], *, unit: str, time_wait_grace: float = 65.0,
                       connection_grace: float = 5.0, replaced: set[int] | frozenset[int] = frozenset(),
                       what: str = "captured listening port", fix: str = RESTORE_PORT_FIX) -> None:
    """Every captured listener must be bindable again, or restore stops here.

    ``replaced`` are the pids of the running workload this restore replaces (it is evicted
    only after prepare passed on every host): a port they hold, and nobody else, is fine.
    A port held only by TIME_WAIT connections of a process that has exited (some kernels
    refuse the bind then, even with SO_REUSEADDR) frees itself within a minute: wait for
    it, up to ``time_wait_grace`` seconds. A port that is the local end of connections and
    no listener (an outgoing connection took it as its ephemeral port) is waited for up to
    ``connection_grace`` seconds: most such connections are short. A listener holding the
    port fails at once.
    """
    for addr, port in listeners:
        family = socket.AF_INET6 if ":" in addr else socket.AF_INET
        started = None
        while True:
            s = socket.socket(family, socket.SOCK_STREAM)
            try:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind((addr, port))
                break
            except OSError as exc:
                if exc.errno == errno.EADDRNOTAVAIL:
                    raise AdmissionError(f"unit {unit}: {what} {addr}:{port} cannot be bound on this host: {addr} is "
                                         f"not one of its addresses", fix=ADDRESS_FIX) from None
                holders = port_holders(port) if exc.errno == errno.EADDRINUSE else set()
                if holders and replaced and holders <= set(replaced):
                    break  # the workload being replaced holds it: eviction frees it
                states = local_states(port)
                if exc.errno == errno.EADDRINUSE and states and LISTEN not in states:
                    only_time_wait = all(st == TIME_WAIT for st in states)
                    grace = time_wait_grace if only_time_wait else connection_grace
                    started = started or time.monotonic()
                    if time.monotonic() < started + grace:
                        time.sleep(0.25)
                        continue
                    holder = (f"TIME_WAIT connections that outlived {grace:.0f}s" if only_time_wait else
                              f"a connection (not a listener) of {_describe(holders) if holders else 'another process'}"
                              f" that outlived {grace:.0f}s")
                else:
                    holder = _describe(holders - set(replaced)) if holders else port_holder(port)
                raise AdmissionError(
                    f"unit {unit}: {what} {addr}:{port} is taken on this host by {holder} ({exc.strerror})",
                    fix=fix,
                ) from None
            finally:
                s.close()


def tids_of(pid: int) -> list[int]:
    """Thread ids of ``pid`` (CRIU restores each at its captured id)."""
    return sorted(int(t.name) for t in Path(f"/proc/{pid}/task").iterdir())


def tree_tids(root: int) -> list[int]:
    """Every thread id of every process of the tree rooted at ``root`` (a multi-process engine)."""
    out: set[int] = set()
    for pid in process_tree(root):
        with contextlib.suppress(OSError):
            out.update(tids_of(pid))
    return sorted(out)


def tree_listeners(root: int) -> list[tuple[str, int]]:
    """The TCP listeners of every process of the tree rooted at ``root`` (CRIU restores them all)."""
    out: set[tuple[str, int]] = set()
    for pid in process_tree(root):
        with contextlib.suppress(OSError):
            out.update(listeners_of(pid))
    return sorted(out)


def pid_max() -> int | None:
    """This kernel's ``kernel.pid_max`` (process and thread ids are below it); None when unreadable."""
    try:
        return int(Path("/proc/sys/kernel/pid_max").read_text().strip())
    except (OSError, ValueError):
        return None


def require_distinct_units(claims: dict[str, list], unit: str, wanted: list, *, what: str) -> None:
    """Units restored on one host never need the same pid (or address and port): each is checked against the
    live host alone, so two that clash would both pass and the second CRIU restore fail after the eviction.
    ``claims``: what the host's units checked so far want, by item; ``wanted`` is added under ``unit``."""
    for item in wanted:
        other = claims.setdefault(item, unit)
        if other != unit:
            shown = f"{item[0]}:{item[1]}" if isinstance(item, tuple) else str(item)
            raise AdmissionError(f"units {other} and {unit} restored on one host both need {what} {shown}",
                                 fix="place them on different hosts (host runtime units keep their captured pids), "
                                     "give their services different ports, or use the docker runtime (a pid "
                                     "namespace per unit)")


# systemd's default kernel.pid_max on 64-bit hosts; the kernel's own default is 32768.
WIDE_PID_MAX = 4194304


def require_pids_free(pids: list[int], *, unit: str, grace: float = 5.0) -> None:
    """CRIU restores processes and threads with their captured ids: they must be unused here. An id held by a
    process that ends within ``grace`` seconds (a short-lived command that a host reusing its pids handed the
    captured one) is waited for; one still held then refuses the restore, naming its holder."""
    deadline = time.monotonic() + grace
    for pid in pids:
        while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        if Path(f"/proc/{pid}").exists():
            comm = "?"
            with contextlib.suppress(OSError):
                comm = Path(f"/proc/{pid}/comm").read_text().strip()
            limit = pid_max()
            # With few pids, the ids wrap within minutes on a busy host: a stranger holding a captured
            # pid is then common, and a wider range makes it rare.
            wrap = (f"; this host's kernel.pid_max is {limit}, so its pids are reused soon: raising it "
                    f"(sysctl -w kernel.pid_max={WIDE_PID_MAX}) makes this rare") \
                if limit is not None and limit < WIDE_PID_MAX else ""
            raise AdmissionError(
                f"unit {unit}: captured pid {pid} is in use on this host by {comm!r} (still after {grace:g} s)",
                fix="CRIU restores processes with their captured pids; stop that process, or use the docker "
                    f"runtime (a fresh pid namespace per unit){wrap}",
            )


# Said by the evict step's check: a stranger took a pid or port after prepare passed, and nothing was evicted.
TAKEN_AFTER_PREPARE = ("taken after prepare passed; the evict step refused before stopping anything: nothing was "
                       "evicted, the workload that ran before keeps running")


def require_restorable(workers: list[dict], *, unit: str, served: Callable[[dict], list[tuple[str, int]]],
                       replaced: set[int] | frozenset[int] = frozenset(), what: str = "captured listening port",
                       pids: bool = True, at_evict: bool = False) -> None:
    """The captured ``workers`` (a unit's capture evidence) can come back on this host: nobody but the
    workload this restore replaces (``replaced``: its pids and thread ids) holds one of their captured pids
    or thread ids (``pids``; a docker unit has a pid namespace of its own) or a port their listeners come
    back on (``served(worker)``: captured, or moved by the restore's placement).

    Prepare runs it before anything is evicted; the evict step runs it again (``at_evict``) right before
    its kill, since prepare may have passed minutes earlier (other hosts preparing, weights downloaded) and
    a stranger that took a pid or port since would make the restore fail with the workload already gone.
    Refused with the holder and the fix named (``at_evict``: saying that nothing was evicted)."""
    try:
        limit = pid_max()
        for w in workers:
            ids = [w["pid"], *w["tids"]]
            if limit is not None and max(ids) >= limit:
                # The kernel refuses to create a process with an id at or above it (CRIU's clone3 with set_tid).
                raise AdmissionError(f"unit {unit}: captured pid {max(ids)} is beyond this host's kernel.pid_max "
                                     f"({limit})", fix=f"raise it (sysctl -w kernel.pid_max={max(ids) + 1} or more), "
                                                       "or restore onto a host whose pid_max is as large as the "
                                                       "capture host's")
            if pids:
                require_pids_free([p for p in ids if p not in replaced], unit=unit)
            require_ports_free(served(w), unit=unit, replaced=replaced, what=what)
    except AdmissionError as exc:
        if not at_evict:
            raise
        raise AdmissionError(f"{exc.problem} ({TAKEN_AFTER_PREPARE})", fix=exc.fix, details=exc.details) from None
