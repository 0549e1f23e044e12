"""Driving CRIU: version, ``criu check``, dump and restore with the options ColdSnap needs.

Established TCP connections are never carried (``--tcp-close``): an engine's
clients reconnect, and the distributed transport is torn down before a dump and
rebuilt after a restore through the coordinator.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import stat
import subprocess
import tarfile
import time
import zlib
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import (
    AdmissionError,
    ColdSnapError,
)

MIN_MAJOR = 4
# CRIU prints these on every run where they apply, and goes on: the first on hosts whose bounding set lacks
# CAP_SYS_RESOURCE, the second where /dev/net/tun is missing (a rank container) as it probes the kernel.
HARMLESS = ("Can't setup RLIMIT_NOFILE", "tun: Unable to create tun")


@dataclass(frozen=True)
class Criu:
    """A CRIU binary, its version and its build id (``GitID`` of ``criu --version``)."""

    binary: str
    version: str
    gitid: str = ""

    @property
    def major(self) -> int:
        return int(self.version.split(".")[0])

    @property
    def coldsnap_build(self) -> bool:
        """ColdSnap's own build (scripts/install-system.sh, with the patches of scripts/criu/), which
        honours CRIU_HUGE_ANON_ENV and CRIU_SKIP_ZERO_ENV; any other CRIU ignores them."""
        return self.gitid.startswith("coldsnap-")


def find_criu(binary: str | None = None) -> Criu:
    """Locate CRIU (>= 4); raise with the install fix otherwise."""
    path = binary or os.environ.get("COLDSNAP_CRIU") or shutil.which("criu") or (
        "/usr/local/sbin/criu" if os.path.exists("/usr/local/sbin/criu") else None)
    if not path:
        raise ColdSnapError("CRIU is not installed on this host",
                            fix="run scripts/install-system.sh (installs CRIU >= 4) or set COLDSNAP_CRIU")
    try:
        out = subprocess.run([path, "--version"], check=False, capture_output=True, text=True, timeout=30).stdout
    except OSError as exc:
        raise ColdSnapError(f"cannot run CRIU at {path}: {exc}", fix="check the binary and its libraries") from exc
    m = re.search(r"^Version:\s*(\S+)", out, re.M)
    if not m:
        raise ColdSnapError(f"cannot read the version of {path}", fix="install CRIU >= 4")
    gitid = re.search(r"^GitID:\s*(\S+)", out, re.M)
    criu = Criu(path, m.group(1), gitid.group(1) if gitid else "")
    if criu.major < MIN_MAJOR:
        raise ColdSnapError(f"CRIU {criu.version} at {path} is too old (need >= {MIN_MAJOR})",
                            fix="run scripts/install-system.sh, which builds CRIU 4.1.1")
    return criu


@dataclass(frozen=True)
class CheckResult:
    ok: bool
    output: str
    failing: tuple[str, ...]


def criu_check(criu: Criu) -> CheckResult:
    """Run ``criu check``; name the failing features when it fails."""
    r = subprocess.run([criu.binary, "check"], check=False, capture_output=True, text=True, timeout=120)
    out = (r.stdout + r.stderr).strip()
    lines = [ln for ln in out.splitlines() if ln.strip() and not any(h in ln for h in HARMLESS)]
    ok = r.returncode == 0 and "Looks good" in out
    failing = tuple(ln.strip() for ln in lines if "Error" in ln or "fail" in ln.lower()) if not ok else ()
    return CheckResult(ok, "\n".join(lines), failing)


def require_check(criu: Criu, host: str = "this host") -> None:
    """Admission: refuse a host whose kernel fails ``criu check``, naming the feature."""
    res = criu_check(criu)
    if not res.ok:
        detail = "; ".join(res.failing[:5]) or res.output[-300:]
        raise AdmissionError(f"'criu check' fails on {host}: {detail}",
                             fix="use a kernel with the features CRIU lists, or another host")


def log_errors(log_path: Path, limit: int = 8) -> list[str]:
    """The meaningful error lines of a CRIU log."""
    try:
        text = Path(log_path).read_text(errors="replace")
    except OSError:
        return []
    errs = [ln.strip() for ln in text.splitlines() if "Error" in ln and not any(h in ln for h in HARMLESS)]
    return errs[-limit:]


def _run(criu: Criu, args: list[str], log_path: Path, what: str, timeout: float, *,
         env: dict[str, str] | None = None, umask: int = -1) -> float:
    t0 = time.monotonic()
    try:
        r = subprocess.run([criu.binary, *args], check=False, capture_output=True, text=True, timeout=timeout,
                           env={**os.environ, **env} if env else None, umask=umask)
    except subprocess.TimeoutExpired:  # CRIU was killed: what its log says so far is all there is
        errs = log_errors(log_path)
        raise ColdSnapError(f"CRIU {what} did not finish within {timeout:.0f}s and was stopped"
                            + (f": {' | '.join(errs)}" if errs else ""),
                            fix=f"see {log_path} for the step CRIU was in (a hung CRIU, or a tree too large "
                                "for the time limit)") from None
    elapsed = time.monotonic() - t0
    if r.returncode != 0:
        errs = log_errors(log_path) or [ln for ln in (r.stdout + r.stderr).splitlines() if ln.strip()][-5:]
        if r.returncode < 0:  # its log stops where it was: say what ended it
            errs.append(f"CRIU was killed by {_signal_name(-r.returncode)} (the OOM killer, or by hand)")
        raise ColdSnapError(f"CRIU {what} failed: {' | '.join(errs) or 'no error lines'}",
                            fix=failure_fix(what, errs, log_path))
    return elapsed


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def failure_fix(what: str, errs: list[str], log_path: Path) -> str:
    """The way out of a failed dump or restore, where its errors say more than "read the log"."""
    if what.startswith("restore") and any("mnt:" in e or "mnt-v2:" in e for e in errs):
        # An engine in a mount namespace of its own (the private /dev/shm) holds a copy of the host's mounts
        # as they were when it started; CRIU re-creates each of them.
        return (f"a mount the captured process tree's mount namespace held is not there to re-create (a mount "
                f"that existed when the engine started, such as a container's overlay or a removed volume): "
                f"find the mount id in {log_path}, make its source available again, or recapture with the engine "
                f"started while no such transient mount exists (the docker runtime gives each unit its own "
                f"mounts)")
    return f"see {log_path} for the full CRIU log"


@dataclass(frozen=True)
class CriuOptions:
    """What a unit's process tree needs from CRIU, decided at capture and recorded in its evidence.

    ``link_remap``: files the tree holds open but has unlinked (a POSIX semaphore in
    ``/dev/shm``) are saved and re-linked (``--link-remap``). ``mount_namespace``: the tree has
    a mount namespace of its own (a private ``/dev/shm``, see the activation runtime's launcher);
    CRIU takes it and its tmpfs contents into the image, and a restore needs ``--root /``.
    """

    link_remap: bool = False
    mount_namespace: bool = False
    shm_archive: bool = False

    def dump_args(self) -> list[str]:
        return ["--link-remap"] if self.link_remap else []

    def restore_args(self) -> list[str]:
        out = ["--link-remap"] if self.link_remap else []
        if self.mount_namespace:
            out += ["--root", "/"]
        return out

    def to_json(self) -> dict:
        out = {"link_remap": self.link_remap, "mount_namespace": self.mount_namespace}
        if self.shm_archive:
            out["shm_archive"] = True
        return out

    @classmethod
    def from_json(cls, data: dict | None) -> CriuOptions:
        data = data or {}
        return cls(link_remap=bool(data.get("link_remap")), mount_namespace=bool(data.get("mount_namespace")),
                   shm_archive=bool(data.get("shm_archive")))


# ``shm_archive``: the tree shares /dev/shm with nothing else but is in the caller's own mount
# namespace (a unit's container, whose /dev/shm is the container's): CRIU does not save that
# tmpfs, so its files (ring buffers, semaphores, CRIU's own link-remap files) are archived beside
# the images after the dump and put back before the restore, into the fresh container's /dev/shm.
SHM_ARCHIVE = "coldsnap-dev-shm.tar.gz"
SHM_DIR = "/dev/shm"


def archive_shm(images_dir: Path, shm_dir: str = SHM_DIR) -> int:
    """Write the regular files and directories of ``shm_dir`` to the images' SHM_ARCHIVE (sockets are
    re-bound by CRIU; nothing else is expected there). Returns the bytes archived."""
    root = Path(shm_dir)
    total = 0
    tmp = Path(images_dir) / (SHM_ARCHIVE + ".part")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)  # as the images
    with os.fdopen(fd, "wb") as raw, \
            tarfile.open(fileobj=raw, mode="w:gz", compresslevel=1, format=tarfile.PAX_FORMAT) as tar:  # mostly zeros
        for path in sorted(root.rglob("*")):
            st = path.lstat()
            if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
                continue
            info = tarfile.TarInfo(path.relative_to(root).as_posix())
            info.mode, info.mtime = stat.S_IMODE(st.st_mode), int(st.st_mtime)
            if stat.S_ISDIR(st.st_mode):
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
                continue
            info.size = st.st_size
            with open(path, "rb") as fh:
                tar.addfile(info, fh)
            total += st.st_size
    os.replace(tmp, Path(images_dir) / SHM_ARCHIVE)
    return total


def _check_shm_members(archive: Path, members: list[tarfile.TarInfo]) -> None:
    """Refuse the whole archive unless every member is a plain relative file or directory and no name is
    used twice or below a file (so nothing is written before an error)."""
    kinds: dict[tuple[str, ...], bool] = {}  # parts -> is a directory
    for info in members:
        parts = PurePosixPath(info.name).parts
        if not parts or info.name.startswith("/") or ".." in parts or not (info.isreg() or info.isdir()):
            raise ColdSnapError(f"{archive}: member {info.name!r} is not a plain relative file or directory",
                                fix="the capsule was altered; restore from the published capsule")
        clash = parts in kinds and not (kinds[parts] and info.isdir())
        below_file = any(kinds.get(parts[:i]) is False for i in range(1, len(parts)))
        if clash or below_file:
            raise ColdSnapError(f"{archive}: member {info.name!r} is named twice or lies below a file of the "
                                "archive", fix="the capsule was altered; restore from the published capsule")
        for i in range(1, len(parts)):
            kinds.setdefault(parts[:i], True)  # its parents are directories: no later file may take their names
        kinds[parts] = info.isdir()


def unpack_shm(images_dir: Path, shm_dir: str = SHM_DIR) -> int:
    """Put the archived /dev/shm files back (regular files and directories only, relative names
    only: the images may come from a capsule someone else built). Returns the files written."""
    archive = Path(images_dir) / SHM_ARCHIVE
    if not archive.is_file():
        raise ColdSnapError(f"{archive} is missing: the capture archived /dev/shm there",
                            fix="restore from the complete capsule")
    root = Path(shm_dir)
    written = 0
    try:
        with tarfile.open(archive, "r:gz") as tar:
            members = tar.getmembers()  # every member checked before the first is written
            _check_shm_members(archive, members)
            for info in members:
                dest = root.joinpath(*PurePosixPath(info.name).parts)
                mode = info.mode & 0o777  # never set-id or sticky bits from an archive
                if info.isdir():
                    dest.mkdir(mode=mode, parents=True, exist_ok=True)
                    continue
                dest.parent.mkdir(parents=True, exist_ok=True)
                src = tar.extractfile(info)
                fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, mode)
                with os.fdopen(fd, "wb") as out:
                    shutil.copyfileobj(src, out)
                os.chmod(dest, mode)
                written += 1
    except (tarfile.TarError, EOFError, zlib.error) as exc:
        raise ColdSnapError(f"{archive} is not a readable gzip'd tar archive ({type(exc).__name__}: {exc})",
                            fix="the capsule was altered or cut short; pull it again or restore from the published "
                                "capsule") from None
    return written


# What ColdSnap's CRIU build (scripts/criu/0003-*.patch) reads at dump: a page of private anonymous
# memory whose bytes are all zero is left out of the images (a private anonymous page that is not
# restored reads as zeros). A CUDA checkpoint parks the process's GPU memory in host memory, much of
# it zeros; so are freed heaps. Other CRIU builds ignore it and dump every present page.
CRIU_SKIP_ZERO_ENV = "COLDSNAP_CRIU_SKIP_ZERO"


@dataclass(frozen=True)
class DumpResult:
    images_dir: str
    bytes: int
    seconds: float


def dump(criu: Criu, pid: int, images_dir: Path, *, leave_running: bool = False, timeout: float = 600,
         options: CriuOptions | None = None) -> DumpResult:
    """Checkpoint the process tree rooted at ``pid`` into ``images_dir``."""
    images_dir = Path(images_dir)
    images_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    args = ["dump", "-t", str(pid), "-D", str(images_dir), "-o", "dump.log", "-v2",
            "--tcp-close", "--skip-in-flight", "--file-locks", *(options or CriuOptions()).dump_args()]
    if leave_running:
        args.append("--leave-running")
    # The images hold the engine's memory (its credentials among it): owner-only files, whatever the umask
    # of whoever runs the capture (CRIU creates them 0644 under the usual 022).
    secs = _run(criu, args, images_dir / "dump.log", "dump", timeout, env={CRIU_SKIP_ZERO_ENV: "1"}, umask=0o077)
    if options is not None and options.shm_archive:
        archive_shm(images_dir)
    size = sum(f.stat().st_size for f in images_dir.iterdir() if f.is_file())
    return DumpResult(str(images_dir), size, secs)


# What ColdSnap's CRIU build (scripts/criu/0002-*.patch) reads: restore private anonymous memory
# of 2 MiB or more as if advised with MADV_HUGEPAGE, advice applied before the pages are read back.
# Other CRIU builds ignore it.
CRIU_HUGE_ANON_ENV = "COLDSNAP_CRIU_HUGE_ANON"


def thp_mode() -> str:
    """This host's transparent huge page mode ('always', 'madvise', 'never'; 'absent' without THP):
    under 'never' a restore asked for huge pages gets 4 KiB pages."""
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return "absent"
    return text.split("[", 1)[1].split("]", 1)[0] if "[" in text else "absent"


# A virtio memory balloon that negotiated free page reporting (feature bit 5) hands the guest's free
# blocks of 2 MiB and more back to the hypervisor a few seconds after they are freed. A huge page is
# such a block, so on those hosts a restore after any idle time takes its huge pages from memory the
# host took back, and each first touch is a fault into the hypervisor; 4 KiB pages come from smaller
# free fragments the guest kept (BENCHMARKS.md: CRIU's restore of a 148-MiB image after 8 s idle took
# 0.37-0.43 s in huge pages, 0.12-0.14 s in 4 KiB pages). A VM with a GPU passed through has its
# memory pinned for the device's DMA, so its hypervisor cannot take reported pages back even where
# the feature was negotiated: a host with an NVIDIA GPU keeps huge pages (where they were measured
# to pay: BENCHMARKS.md, the H200 sections).
VIRTIO_DEVICES = Path("/sys/bus/virtio/devices")
NVIDIA_GPUS = Path("/proc/driver/nvidia/gpus")
_VIRTIO_BALLOON = "0x0005"
_F_FREE_PAGE_REPORTING = 5


def free_page_reporting(devices: Path = VIRTIO_DEVICES) -> bool:
    """Whether a virtio balloon driver on this host reports free pages to its hypervisor."""
    try:
        entries = sorted(devices.iterdir())
    except OSError:
        return False
    for dev in entries:
        try:
            if (dev / "device").read_text().strip() != _VIRTIO_BALLOON or not (dev / "driver").exists():
                continue
            features = (dev / "features").read_text().strip()
        except OSError:
            continue
        if len(features) > _F_FREE_PAGE_REPORTING and features[_F_FREE_PAGE_REPORTING] == "1":
            return True
    return False


def huge_pages_by_default(devices: Path = VIRTIO_DEVICES, nvidia_gpus: Path = NVIDIA_GPUS) -> bool:
    """Whether a restore reads memory back into huge pages when the unit's environment does not say:
    yes, except on a host without an NVIDIA GPU whose free memory goes back to its hypervisor."""
    try:
        if any(nvidia_gpus.iterdir()):
            return True
    except OSError:
        pass
    return not free_page_reporting(devices)


@dataclass(frozen=True)
class RestoreResult:
    pid: int
    seconds: float


def private_work_dir(path: Path) -> Path:
    """A fresh 0700 directory for CRIU's log and pid file (never the image directory, which is sealed
    captured state and may come from a capsule someone else built)."""
    path = Path(path)
    if path.is_symlink():
        raise ColdSnapError(f"CRIU work directory {path} is a symbolic link", fix="remove it")
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(path, 0o700)
    for name in ("restore.log", "restore.pid"):
        p = path / name
        if p.is_symlink() or p.exists():
            p.unlink()
    return path


def restore(criu: Criu, images_dir: Path, *, work_dir: Path, leave_stopped: bool = False, sibling: bool = False,
            timeout: float = 600, options: CriuOptions | None = None, huge_pages: bool = False) -> RestoreResult:
    """Restore the tree detached (``sibling``: as a child of the caller, for supervisors).

    CRIU writes its log and pid file into ``work_dir`` (``-W``), created fresh and private; the
    image directory is only read. ``huge_pages``: ColdSnap's CRIU build reads the private anonymous
    memory of 2 MiB or more back into transparent huge pages (advised with ``MADV_HUGEPAGE``,
    which the restored processes keep) — on THP-``madvise`` hosts much faster than 4 KiB faults.
    """
    images_dir = Path(images_dir)
    work = private_work_dir(work_dir)
    pidfile = work / "restore.pid"
    args = ["restore", "-D", str(images_dir.absolute()), "-W", str(work.absolute()), "-o", "restore.log", "-v2", "-d",
            "--pidfile", str(pidfile.absolute()), "--tcp-close", "--file-locks",
            *(options or CriuOptions()).restore_args()]
    if leave_stopped:
        args.append("--leave-stopped")
    if sibling:
        args.append("--restore-sibling")
    if options is not None and options.shm_archive:
        unpack_shm(images_dir)
    secs = _run(criu, args, work / "restore.log", "restore", timeout,
                env={CRIU_HUGE_ANON_ENV: "1"} if huge_pages else None)
    return RestoreResult(int(pidfile.read_text().strip()), secs)


def image_bytes(images_dir: Path) -> int:
    """Total size of a CRIU image directory."""
    return sum(f.stat().st_size for f in Path(images_dir).iterdir() if f.is_file())
