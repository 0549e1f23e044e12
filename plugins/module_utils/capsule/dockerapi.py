"""The Docker SDK, imported lazily, and the few image operations ColdSnap builds on.

module_utils must import on a bare host (runtime ``host`` has no Docker), so the
SDK is loaded only by the functions that need it, with a clear error when it is
missing. Images are always addressed by content: a ``name@sha256:<hex>`` reference
or a ``sha256:<id>`` image id, never a mutable tag.
"""

from __future__ import annotations

import os
import re
import tarfile
import threading
from collections.abc import Callable, Iterable
from typing import Any

from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import (
    ColdSnapError,
    IntegrityError,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats import identifiers as ids

DOCKER_FIX = "install the Docker SDK for Python ('pip install docker>=7.1') on this host"


def docker_module() -> Any:
    """The ``docker`` package, or a ColdSnapError saying how to get it."""
    try:
        import docker
    except ImportError as exc:
        raise ColdSnapError(f"the Docker SDK for Python is missing ({exc})", fix=DOCKER_FIX) from exc
    return docker


def docker_client(client: Any = None, *, timeout: int = 600) -> Any:
    """``client`` when given, else a client for the environment's daemon (DOCKER_HOST or the local socket)."""
    if client is not None:
        return client
    docker = docker_module()
    try:
        c = docker.from_env(timeout=timeout)
        c.ping()
    except docker.errors.DockerException as exc:
        raise ColdSnapError(f"cannot reach the Docker daemon ({exc})",
                            fix="start dockerd ('systemctl start docker') and check access to its socket") from exc
    return c


def is_not_found(exc: BaseException) -> bool:
    docker = docker_module()
    return isinstance(exc, docker.errors.NotFound | docker.errors.ImageNotFound)


def resolve_image(client: Any, ref: str, *, what: str = "image") -> Any:
    """The local image an immutable reference names.

    Accepted: ``sha256:<hex>`` (an image id) or ``name[:tag]@sha256:<hex>``. The
    latter is first looked up as a repository digest (an image pulled from a
    registry); a locally built or imported image has none, so its digest is then
    taken as its image id, which is the SHA-256 of its config and so pins its
    content just as firmly.
    """
    docker = docker_module()
    if ids.is_digest(ref):
        digest, name = ref, None
    else:
        name, digest = ids.split_image_ref(ref)
    if name is not None:
        try:
            return client.images.get(ref)
        except docker.errors.ImageNotFound:
            pass
        except docker.errors.APIError as exc:
            if getattr(exc, "status_code", None) not in (400, 404):
                raise ColdSnapError(f"{what} {ref}: the Docker daemon failed to look it up ({exc})",
                                    fix="check dockerd's health") from exc
    try:
        image = client.images.get(digest)
    except docker.errors.ImageNotFound:
        raise ColdSnapError(f"{what} {ref} is not present in the local Docker image store",
                            fix="build it (runtime_image/build.py), pull it by digest, or load it first") from None
    if image.id != digest:
        raise IntegrityError(f"{what} {ref} resolved to image {image.id}, not {digest}",
                             fix="refer to images by their full 'sha256:' id or repository digest")
    return image


def pinned_ref(name: str, image_id: str) -> str:
    """``name@sha256:<hex>`` for a local image id; a tag on ``name`` is dropped (it is mutable)."""
    ids.parse_digest(image_id, what="image id")
    name = name.split("@", 1)[0]
    head, _sep, last = name.rpartition("/")
    if ":" in last:
        last = last.split(":", 1)[0]
    return f"{head + '/' if head else ''}{last}@{image_id}"


_NAME_BAD = re.compile(r"[^a-z0-9._-]+")


def sanitize_repo_component(value: str) -> str:
    """A docker repository path component from an identifier (lower case, safe separators)."""
    out = _NAME_BAD.sub("-", value.lower()).strip("._-")
    out = re.sub(r"[._-]{2,}", "-", out)
    return out or "x"


def sanitize_tag(value: str) -> str:
    """A docker tag (``[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}``) from an identifier."""
    out = re.sub(r"[^A-Za-z0-9_.-]+", "-", value)
    out = out.lstrip(".-") or "x"
    return out[:128]


class _TarPipe:
    """A tar written by a producer thread into a pipe whose read end the Docker SDK streams to dockerd."""

    def __init__(self, write: Callable[[tarfile.TarFile], None]) -> None:
        rfd, wfd = os.pipe()
        self.reader = os.fdopen(rfd, "rb", buffering=1 << 20)
        self._writer = os.fdopen(wfd, "wb", buffering=1 << 20)
        self._write = write
        self.failure: BaseException | None = None
        self._thread = threading.Thread(target=self._produce, name="coldsnap-docker-stream", daemon=True)

    def _produce(self) -> None:
        try:
            with tarfile.open(fileobj=self._writer, mode="w|", format=tarfile.PAX_FORMAT) as tar:
                self._write(tar)
        except BaseException as exc:
            self.failure = exc
        finally:
            try:
                self._writer.close()
            except OSError:
                pass

    def __enter__(self) -> _TarPipe:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        # Closing the read end unblocks the producer if the daemon stopped reading early.
        try:
            self.reader.close()
        except OSError:
            pass
        self._thread.join()

    def raise_failure(self) -> None:
        if self.failure is not None and not isinstance(self.failure, BrokenPipeError):
            raise self.failure


def _stream_errors(events: Iterable[dict], tail: list[str], on_line: Callable[[str], None] | None) -> str | None:
    error = None
    for ev in events:
        if "stream" in ev:
            line = str(ev["stream"]).rstrip("\n")
            if line.strip():
                tail[:] = [*tail, line][-20:]
                if on_line:
                    on_line(line)
        if "error" in ev or "errorDetail" in ev:
            error = str(ev.get("error") or (ev.get("errorDetail") or {}).get("message"))
    return error


def stream_load(client: Any, write_archive: Callable[[tarfile.TarFile], None], *, what: str) -> None:
    """``docker load`` an image archive written by ``write_archive`` (streamed, never staged on disk)."""
    docker = docker_module()
    tail: list[str] = []
    with _TarPipe(write_archive) as pipe:
        try:
            error = _stream_errors(client.api.load_image(pipe.reader), tail, None)
        except docker.errors.APIError as exc:
            error = str(exc.explanation or exc)
    pipe.raise_failure()
    if error:
        raise ColdSnapError(f"docker load of {what} failed: {error}",
                            fix="check disk space and that the base image is still present")


def stream_build(client: Any, write_context: Callable[[tarfile.TarFile], None], *, tag: str,
                 labels: dict[str, str] | None = None, buildargs: dict[str, str] | None = None,
                 dockerfile: str = "Dockerfile", what: str = "image",
                 on_line: Callable[[str], None] | None = None) -> str:
    """Build an image from a context tar written by ``write_context`` (streamed, never staged on disk).

    Returns the new image id (``sha256:...``). Build errors raise ColdSnapError with
    the builder's last lines.
    """
    docker = docker_module()
    tail: list[str] = []
    image_id: str | None = None
    error: str | None = None

    def watch(line: str) -> None:
        nonlocal image_id
        m = re.fullmatch(r"Successfully built ([0-9a-f]{12,64})\s*", line)
        if m:  # the builder's own last line (a RUN step's output may say the same earlier)
            image_id = m.group(1)
        if on_line:
            on_line(line)

    with _TarPipe(write_context) as pipe:
        try:
            events = client.api.build(
                fileobj=pipe.reader, custom_context=True, tag=tag, labels=labels or None,
                buildargs=buildargs or None, dockerfile=dockerfile, rm=True, forcerm=True, pull=False, decode=True)
            error = _stream_errors(events, tail, watch)
        except docker.errors.APIError as exc:
            error = str(exc)
    pipe.raise_failure()
    if error or image_id is None:
        last = "\n".join(tail[-10:])
        raise ColdSnapError(f"docker build of {what} failed: {error or 'no image id reported'}\n{last}".rstrip(),
                            fix="read the builder output above; check disk space and the base image")
    # The image the build made, by its id: the tag may have moved meanwhile (a concurrent build).
    return client.images.get(image_id).id


def add_bytes(tar: tarfile.TarFile, name: str, data: bytes, *, mode: int = 0o644) -> None:
    """Add an in-memory file to a build context."""
    import io

    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mode = mode
    info.mtime = 0
    tar.addfile(info, io.BytesIO(data))


def add_file(tar: tarfile.TarFile, name: str, path: str | os.PathLike, *, mode: int | None = None) -> None:
    """Add a host file to a build context (owner 0:0)."""
    info = tar.gettarinfo(os.fspath(path), arcname=name)
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    if mode is not None:
        info.mode = mode
    if info.isreg():
        with open(path, "rb") as fh:
            tar.addfile(info, fh)
    else:
        tar.addfile(info)


def image_labels(image: Any) -> dict[str, str]:
    return dict(((image.attrs.get("Config") or {}).get("Labels")) or {})
