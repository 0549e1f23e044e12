"""Build the ColdSnap runtime image from a locally produced, digest-pinned base.

    python runtime_image/build.py [--base-only] [--tag NAME] [--base-tag NAME] [--cache-dir DIR] [--criu PATH]
                                  [--engine vllm [--engine-python PATH]]

prints one JSON object: ``{"base_image": "coldsnap-base@sha256:..", "runtime_image":
"coldsnap-runtime@sha256:..", "image_id": "sha256:..", ...}``. Requests refer to the
runtime image only by that digest (a local image id: the SHA-256 of the image config,
which pins every layer).

No container registry can be reached, so the base is built here: debootstrap of the
host's own Debian suite (the mirror read from this machine's apt sources) with python3
and the runtime libraries of the pinned CRIU binary, tarred and ``docker import``ed.
On top of it go the pinned wheels (torch CPU from the local wheel directory, numpy,
safetensors; installed offline with ``--require-hashes``), the CRIU binary, and this
collection's code (``plugins/`` as ``ansible_collections/coldsnap/fleet`` plus
``runtime_image/integrations/coldsnap_engines`` in ``/opt/coldsnap/site``, on sys.path).
The activation runtime is not baked in: it is staged per host and mounted read-only.

Caching: each image is labelled with the digest of its inputs; a rebuild with unchanged
inputs finds the labelled image and returns at once. The debootstrap tarball and the
downloaded wheels are kept under the cache directory, so even a rebuild after
``docker rmi`` needs no network and no debootstrap.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
BUILD_FORMAT = 1
DEFAULT_TAG = "coldsnap-runtime"
DEFAULT_BASE_TAG = "coldsnap-base"
BASE_EXTRA_PACKAGES = ("python3", "procps")
# Python of each Debian suite's python3 package (the wheels must match it).
SUITE_PYTHON = {"bookworm": "3.11", "trixie": "3.13"}
LABEL_KIND = "org.coldsnap.kind"
LABEL_INPUTS = "org.coldsnap.inputs"

try:
    from ansible_collections.coldsnap.fleet.plugins.module_utils.capsule import archive, dockerapi
    from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import ColdSnapError
    from ansible_collections.coldsnap.fleet.plugins.module_utils.common.fsutil import (
        atomic_write_bytes,
        file_lock,
    )
    from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.canonical import canonical_sha256
    from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.versions import (
        ACTIVATION_RUNTIME_ABI,
        COLDSNAP_VERSION,
    )
except ImportError as _exc:  # pragma: no cover - a checkout without the venv
    sys.exit(f"runtime_image/build.py: cannot import the collection ({_exc}); run scripts/setup-venv.sh and "
             "use the virtualenv's python")


def log(msg: str) -> None:
    print(f"[runtime-image] {msg}", file=sys.stderr, flush=True)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def default_cache_dir() -> Path:
    env = os.environ.get("COLDSNAP_CACHE_DIR")
    if env:
        return Path(env) / "runtime-image"
    if os.geteuid() == 0:
        return Path("/var/cache/coldsnap/runtime-image")
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "coldsnap" / "runtime-image"


# ----------------------------------------------------------------------------- host facts

def host_suite() -> str:
    fields = dict(line.split("=", 1) for line in Path("/etc/os-release").read_text().splitlines() if "=" in line)
    suite = fields.get("VERSION_CODENAME", "").strip('"')
    if not suite:
        raise ColdSnapError("cannot tell this host's Debian suite from /etc/os-release",
                            fix="pass --suite (the suite the CRIU binary was built on)")
    return suite


def dpkg_arch() -> str:
    return subprocess.run(["dpkg", "--print-architecture"], check=True, capture_output=True, text=True).stdout.strip()


def find_criu(explicit: str | None) -> tuple[Path, str]:
    path = Path(explicit) if explicit else Path(shutil.which("criu") or "/usr/local/sbin/criu")
    if not path.is_file():
        raise ColdSnapError(f"CRIU binary {path} not found",
                            fix="install CRIU >= 4 (scripts/install-system.sh) or pass --criu PATH")
    out = subprocess.run([str(path), "--version"], check=False, capture_output=True, text=True).stdout
    m = re.search(r"^Version:\s*(\S+)", out, re.M)
    if not m or int(m.group(1).split(".")[0]) < 4:
        raise ColdSnapError(f"{path} is not CRIU >= 4 ({out.strip()[:80]!r})", fix="pass --criu with CRIU 4.x")
    return path.resolve(), m.group(1)


def library_packages(binary: Path) -> list[str]:
    """The Debian packages holding the shared libraries ``binary`` links against (one dpkg query)."""
    out = subprocess.run(["ldd", str(binary)], check=True, capture_output=True, text=True).stdout
    libs = [m.group(1) for m in re.finditer(r"=>\s+(/\S+)", out)]
    candidates = {lib: [lib, os.path.realpath(lib)] for lib in libs}
    query = sorted({c for cs in candidates.values() for c in cs})
    r = subprocess.run(["dpkg", "-S", *query], check=False, capture_output=True, text=True)
    owner: dict[str, str] = {}
    for line in r.stdout.splitlines():
        pkgs, sep, path = line.partition(": ")
        if sep:
            owner[path.strip()] = pkgs.split(",")[0].split(":")[0].strip()
    found: set[str] = set()
    for lib, cands in candidates.items():
        pkg = next((owner[c] for c in cands if c in owner), None)
        if pkg is None:
            raise ColdSnapError(f"{binary} links {lib}, which no Debian package provides",
                                fix="use a CRIU built against Debian packages (scripts/install-system.sh)")
        found.add(pkg)
    found.discard("libc6")  # always in minbase
    return sorted(found)


# ----------------------------------------------------------------------------- base image

def find_labelled(client: Any, kind: str, inputs: str) -> Any | None:
    """The image built from exactly these inputs, if any.

    Labels are inherited by derived images, so a base must also be a single
    imported layer (a child that forgot to relabel itself is never taken for it).
    """
    images = client.images.list(filters={"label": [f"{LABEL_KIND}={kind}", f"{LABEL_INPUTS}={inputs}"]})
    if kind == "base":
        images = [i for i in images if len((i.attrs.get("RootFS") or {}).get("Layers") or []) == 1]
    return sorted(images, key=lambda i: i.attrs.get("Created", ""))[0] if images else None


def build_base(client: Any, *, cache: Path, suite: str, arch: str, packages: list[str], tag: str,
               timings: dict[str, float]) -> tuple[Any, bool]:
    script = HERE / "base" / "mkbase.sh"
    inputs = canonical_sha256({"format": BUILD_FORMAT, "suite": suite, "arch": arch, "packages": packages,
                               "script": sha256_file(script)})
    hexpart = inputs.split(":", 1)[1]
    image = find_labelled(client, "base", inputs)
    if image is not None:
        return image, True
    tarball = cache / "base" / f"{hexpart}.tar"
    if not tarball.exists():
        log(f"debootstrap {suite}/{arch} with {len(packages)} extra packages (first build only)")
        t0 = time.monotonic()
        subprocess.run(["bash", str(script), suite, ",".join(packages), str(tarball)], check=True)
        timings["debootstrap_s"] = round(time.monotonic() - t0, 1)
    log(f"docker import {tarball.name}")
    t0 = time.monotonic()
    changes = [f"LABEL {LABEL_KIND}=base", f"LABEL {LABEL_INPUTS}={inputs}", f"LABEL org.coldsnap.suite={suite}",
               'CMD ["python3"]', "ENV LANG=C.UTF-8"]
    client.api.import_image(src=str(tarball), repository=tag, tag=hexpart[:12], changes=changes)
    timings["import_s"] = round(time.monotonic() - t0, 1)
    image = find_labelled(client, "base", inputs)
    if image is None:
        raise ColdSnapError(f"docker import of {tarball} produced no labelled image", fix="check dockerd's logs")
    return image, False


# ----------------------------------------------------------------------------- wheels

def wheelhouse(cache: Path, python: str, arch: str) -> Path:
    """Download (once) every wheel the requirements need, plus pip; write requirements.lock with hashes."""
    req = HERE / "requirements.txt"
    # What torch brings along (filelock, sympy, ...) at the releases the suite last passed with.
    pins = REPO / "scripts" / "constraints" / "venv.txt"
    platform_tag = {"amd64": "x86_64", "arm64": "aarch64"}.get(arch, arch)
    key = hashlib.sha256(req.read_bytes() + pins.read_bytes() + f"|{python}|{platform_tag}".encode()).hexdigest()[:16]
    house = cache / "wheels" / key
    if (house / ".complete").exists():
        return house
    tmp = house.with_name(house.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    pyver = python.replace(".", "")
    plats = [f"manylinux_2_{n}_{platform_tag}" for n in range(28, 16, -1)] + [f"manylinux2014_{platform_tag}"]

    def download(requirements: Path) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "pip", "download", "-q", "-d", str(tmp), "--only-binary=:all:",
               "--python-version", python, "--implementation", "cp", "--abi", f"cp{pyver}", "--abi", "abi3",
               "--abi", "none"] + [a for p in plats for a in ("--platform", p)] + ["-c", str(pins), "-r", str(requirements), "pip"]
        return subprocess.run(cmd, check=False, capture_output=True, text=True)

    log("downloading the pinned wheels (first build only; torch comes from PIP_FIND_LINKS)")
    r = download(req)
    if r.returncode != 0 and "+cpu" in r.stderr:
        # No CPU build of the pinned torch for this suite's Python (the local wheel directory
        # carries one Python's): take PyPI's default build of the same release instead.
        log(f"no CPU build of torch for Python {python} here; using PyPI's default build of the same "
            "release (with its CUDA libraries: several GB, first build only)")
        fallback = tmp / "requirements-pypi.txt"
        fallback.write_text(re.sub(r"\+cpu\b", "", req.read_text()))
        r = download(fallback)
        fallback.unlink()
    if r.returncode != 0:
        raise ColdSnapError(f"pip download of the runtime wheels failed: {r.stderr.strip()[-800:]}",
                            fix="check PIP_FIND_LINKS (the CPU torch wheel) and PyPI access")
    lines = []
    for whl in sorted(tmp.glob("*.whl")):
        name, version = whl.name.split("-")[:2]
        if name.lower() == "pip":
            continue
        lines.append(f"{name.replace('_', '-').lower()}=={version} --hash=sha256:{sha256_file(whl)}")
    (tmp / "requirements.lock").write_text("\n".join(lines) + "\n")
    (tmp / ".complete").write_text("ok\n")
    if house.exists():
        shutil.rmtree(house)
    tmp.rename(house)
    return house


# ----------------------------------------------------------------------------- context

def plugin_dist_info(cache: Path) -> list[archive.LayerEntry]:
    """``coldsnap_engines`` distribution metadata, so vLLM and SGLang discover the ColdSnap plugins
    through their entry points inside the image (the code itself is plain files on sys.path)."""
    sys.path.insert(0, str(HERE / "integrations"))
    try:
        from coldsnap_engines.common.distinfo import write_dist_info
    finally:
        sys.path.pop(0)
    gen = cache / "distinfo"
    shutil.rmtree(gen, ignore_errors=True)
    d = write_dist_info(gen, COLDSNAP_VERSION)
    return [archive.LayerEntry(f"site/{d.name}/{f.name}", f) for f in sorted(d.iterdir())]


def site_entries() -> list[archive.LayerEntry]:
    """This collection's code as it appears below /opt/coldsnap/site (no caches, no activation runtime)."""
    def skip(rel: str) -> bool:
        return "__pycache__" in rel.split("/") or rel.endswith((".pyc", ".pyo"))

    entries, _unused = archive.collect_tree(REPO / "plugins", "site/ansible_collections/coldsnap/fleet/plugins",
                                            exclude=skip, what="collection plugins")
    for meta in ("galaxy.yml", "meta/runtime.yml"):
        if (REPO / meta).is_file():
            entries.append(archive.LayerEntry(f"site/ansible_collections/coldsnap/fleet/{meta}", REPO / meta))
    engines = HERE / "integrations" / "coldsnap_engines"
    if engines.is_dir():
        more, _unused = archive.collect_tree(engines, "site/coldsnap_engines", exclude=skip, what="engine integrations")
        entries += more
    return entries


def console_scripts() -> dict[str, bytes]:
    """Wrappers for the project's console scripts that live in the image (coldsnap_engines.*)."""
    data = tomllib.loads((REPO / "pyproject.toml").read_text())
    out = {}
    for name, target in sorted(data.get("project", {}).get("scripts", {}).items()):
        module, _sep, func = target.partition(":")
        if not module.startswith("coldsnap_engines"):
            continue
        out[name] = (f"#!/usr/bin/python3\nimport sys\nfrom {module} import {func}\n"
                     f"sys.exit({func}())\n").encode()
    out["coldsnap-runtime-info"] = b"#!/bin/sh\nexec cat /opt/coldsnap/runtime.json\n"
    return out


def runtime_build(client: Any, *, base: Any, cache: Path, criu: Path, criu_version: str, python: str, arch: str,
                  tag: str, timings: dict[str, float]) -> tuple[Any, bool, str]:
    house = wheelhouse(cache, python, arch)
    wheels = sorted(house.glob("*.whl"))
    lock = (house / "requirements.lock").read_text()
    entries = site_entries() + plugin_dist_info(cache)
    scripts = console_scripts()
    pth = b"/opt/coldsnap/site\n/opt/coldsnap/python\n"
    dockerfile = (HERE / "Dockerfile").read_bytes()
    criu_sha = sha256_file(criu)
    files_fp = [[e.arcname, sha256_file(e.source) if e.source and e.source.is_file() else "",
                 os.lstat(e.source).st_mode & 0o7777 if e.source else 0o755] for e in entries]
    inputs = canonical_sha256({
        "format": BUILD_FORMAT, "base": base.id, "dockerfile": hashlib.sha256(dockerfile).hexdigest(),
        "lock": lock, "pip": [w.name for w in wheels if w.name.startswith("pip-")], "criu": criu_sha,
        "site": files_fp, "scripts": {k: hashlib.sha256(v).hexdigest() for k, v in scripts.items()},
        "pth": pth.decode(), "version": COLDSNAP_VERSION, "abi": ACTIVATION_RUNTIME_ABI})
    image = find_labelled(client, "runtime", inputs)
    if image is not None:
        return image, True, inputs
    runtime_json = json.dumps({
        "format": 1, "kind": "coldsnap-runtime-image", "inputs": inputs, "coldsnap_version": COLDSNAP_VERSION,
        "activation_runtime_abi": ACTIVATION_RUNTIME_ABI, "base_image": base.id, "python": python,
        "criu": {"version": criu_version, "sha256": "sha256:" + criu_sha, "path": "/usr/local/sbin/criu"},
        "requirements": lock.splitlines()}, indent=2, sort_keys=True).encode() + b"\n"

    def write_context(tar: Any) -> None:
        dockerapi.add_bytes(tar, "Dockerfile", dockerfile)
        for whl in wheels:
            dockerapi.add_file(tar, f"wheels/{whl.name}", whl, mode=0o644)
        dockerapi.add_bytes(tar, "wheels/requirements.lock", lock.encode())
        dockerapi.add_file(tar, "criu", criu, mode=0o755)
        for name, body in scripts.items():
            dockerapi.add_bytes(tar, f"bin/{name}", body, mode=0o755)
        dockerapi.add_bytes(tar, "coldsnap.pth", pth)
        dockerapi.add_bytes(tar, "runtime.json", runtime_json)
        archive.add_entries(tar, entries)

    labels = {LABEL_KIND: "runtime", LABEL_INPUTS: inputs, "org.coldsnap.criu.version": criu_version,
              "org.coldsnap.criu.sha256": "sha256:" + criu_sha, "org.coldsnap.base": base.id,
              "org.coldsnap.activation-runtime.abi": str(ACTIVATION_RUNTIME_ABI),
              "org.coldsnap.version": COLDSNAP_VERSION}
    log("docker build of the runtime image")
    t0 = time.monotonic()
    image_id = dockerapi.stream_build(client, write_context, tag=f"{tag}:{inputs.split(':', 1)[1][:12]}",
                                      labels=labels, buildargs={"BASE": base.id}, what="the runtime image",
                                      on_line=lambda line: log("  " + line.strip()) if line.startswith("Step") else None)
    timings["runtime_build_s"] = round(time.monotonic() - t0, 1)
    drop_build_stage(client)
    return client.images.get(image_id), False, inputs


def drop_build_stage(client: Any) -> None:
    """Remove the wheels stage the build left behind, untagged: the wheels and the tree installed from
    them, over a GB that the image itself never uses (it copies the installed tree only)."""
    docker = dockerapi.docker_module()
    try:
        res = client.images.prune(filters={"dangling": True, "label": f"{LABEL_KIND}=build-stage"})
    except docker.errors.APIError as exc:  # a concurrent prune, a daemon that refuses: only space is lost
        log(f"kept the build stage: {exc.explanation or exc}")
        return
    freed = int(res.get("SpaceReclaimed") or 0)
    if freed:
        log(f"removed the build stage ({freed / 1e9:.2f} GB)")


# ----------------------------------------------------------------------------- engine variants

# engine -> its package directory in the environment, and how it loads the compiled kernels this CPU takes.
# vLLM ships one kernel library per x86 level (_C: AVX-512 with BF16, _C_AVX512, _C_AVX2); importing one
# the CPU lacks dies of SIGILL, so the check lets vLLM choose, as at start-up, and links every one of them.
ENGINE_KERNELS = {"vllm": ("vllm", "from vllm.platforms import current_platform\n"
                                   "current_platform.import_kernels()\n"
                                   "torch.ops._C.silu_and_mul  # an op every CPU build registers\n")}
# What a variant's build runs last: every shared library the engine's compiled modules link is found in the
# image (torch's own beside torch), and the kernels this CPU takes load and register their ops. PACKAGE, LOAD
# and ENGINE are set in lines above it.
ENGINE_CHECK = """import os, subprocess, sys
import torch
root = os.path.join("/opt/coldsnap/engines", ENGINE, PACKAGE)
env = dict(os.environ, LD_LIBRARY_PATH=os.path.join(os.path.dirname(torch.__file__), "lib"))
missing = []
for name in sorted(os.listdir(root)):
    if name.endswith(".so"):
        out = subprocess.run(["ldd", os.path.join(root, name)], capture_output=True, text=True, env=env).stdout
        missing += [f"{name}: {line.split()[0]}" for line in out.splitlines() if "not found" in line]
if missing:
    sys.exit(f"the {ENGINE} variant lacks shared libraries: {', '.join(missing)}")
try:
    exec(LOAD)
except (ImportError, AttributeError, RuntimeError) as exc:
    sys.exit(f"{PACKAGE}'s compiled kernels do not load in the {ENGINE} variant: {exc}")
"""
# Debian packages an engine needs beyond the runtime's: vLLM's CPU kernels compile with TorchInductor
# (a C++ compiler, Python.h, and openssl to hash headers, at start-up even with --enforce-eager) and link libnuma.
ENGINE_PACKAGES = {"vllm": ("g++", "libnuma1", "openssl", "python3-dev")}


def _engine_skip(rel: str) -> bool:
    """What of an engine environment stays out of its image: caches, and this project's own editable
    install (the image carries ColdSnap's code and plugin entry points itself)."""
    top = rel.split("/", 1)[0]
    return ("__pycache__" in rel.split("/") or rel.endswith((".pyc", ".pth")) or top.startswith("__editable__")
            or (top.startswith("coldsnap-") and top.endswith(".dist-info")))


def engine_site(engine: str, python: str | None) -> tuple[Path, str, str]:
    """The engine environment's site-packages, its Python version and its identity (the directory's
    name, which carries the pinned versions' key), building the environment if needed."""
    if python is None:
        r = subprocess.run(["bash", str(REPO / "scripts" / "engine-env.sh"), engine], capture_output=True,
                           text=True, check=False)
        if r.returncode != 0:
            raise ColdSnapError(f"scripts/engine-env.sh {engine} failed: {r.stderr.strip()[-800:]}",
                                fix="build the engine environment first (it needs PyPI access once)")
        python = r.stdout.strip().splitlines()[-1]
    try:
        r = subprocess.run([python, "-c", "import sys, sysconfig; print(sysconfig.get_paths()['purelib']); "
                            "print('%d.%d' % sys.version_info[:2])"], capture_output=True, text=True, check=False)
        problem = None if r.returncode == 0 and len(r.stdout.split()) == 2 else \
            (r.stderr.strip()[-400:] or f"exit status {r.returncode}")
    except OSError as exc:
        problem = exc.strerror or str(exc)
    if problem is not None:
        raise ColdSnapError(f"--engine-python {python} does not run as the {engine} environment's python: {problem}",
                            fix=f"give that environment's bin/python, or leave --engine-python out "
                                f"(scripts/engine-env.sh {engine} builds or finds it)")
    site, version = r.stdout.split()
    return Path(site), version, Path(python).parents[1].name


def engine_build(client: Any, *, runtime: Any, engine: str, python: str, engine_python: str | None, tag: str,
                 timings: dict[str, float]) -> tuple[Any, bool, str]:
    """The runtime image plus ``engine``'s environment (see Dockerfile.engine); cached by its inputs."""
    site, env_python, env_id = engine_site(engine, engine_python)
    if env_python != python:
        raise ColdSnapError(f"the {engine} environment runs Python {env_python}, the runtime image's base "
                            f"Python {python}",
                            fix=f"build the environment with the base suite's python3 "
                                f"(PYTHON=python{python} scripts/engine-env.sh {engine})")
    entries, _unused = archive.collect_tree(site, "site", exclude=_engine_skip, what=f"the {engine} environment")
    dists = sorted(e.arcname.split("/")[1] for e in entries if e.arcname.count("/") == 1
                   and e.arcname.endswith(".dist-info"))
    dockerfile = (HERE / "Dockerfile.engine").read_bytes()
    package, load = ENGINE_KERNELS[engine]
    check = f"PACKAGE = {package!r}\nLOAD = {load!r}\nENGINE = {engine!r}\n{ENGINE_CHECK}".encode()
    inputs = canonical_sha256({"format": BUILD_FORMAT, "runtime": runtime.id, "engine": engine, "environment": env_id,
                               "dists": dists, "dockerfile": hashlib.sha256(dockerfile).hexdigest(),
                               "check": hashlib.sha256(check).hexdigest()})
    image = find_labelled(client, "runtime", inputs)
    if image is not None:
        return image, True, inputs
    engine_json = json.dumps({"format": 1, "kind": "coldsnap-engine-variant", "engine": engine,
                              "environment": env_id, "python": python, "runtime_image": runtime.id,
                              "distributions": dists}, indent=2, sort_keys=True).encode() + b"\n"

    def write_context(tar: Any) -> None:
        dockerapi.add_bytes(tar, "Dockerfile", dockerfile)
        dockerapi.add_bytes(tar, "engine.pth", f"/opt/coldsnap/engines/{engine}\n".encode())
        dockerapi.add_bytes(tar, "engine.json", engine_json)
        dockerapi.add_bytes(tar, "check.py", check)
        archive.add_entries(tar, entries)

    labels = {**{k: v for k, v in (runtime.labels or {}).items() if k.startswith("org.coldsnap.")},
              LABEL_KIND: "runtime", LABEL_INPUTS: inputs, "org.coldsnap.engine": engine,
              "org.coldsnap.runtime-image": runtime.id}
    log(f"docker build of the {engine} variant ({len(entries)} files of {site})")
    t0 = time.monotonic()
    image_id = dockerapi.stream_build(client, write_context, tag=f"{tag}:{inputs.split(':', 1)[1][:12]}",
                                      labels=labels, buildargs={"RUNTIME": runtime.id, "ENGINE": engine},
                                      what=f"the {engine} variant of the runtime image")
    timings[f"{engine}_build_s"] = round(time.monotonic() - t0, 1)
    return client.images.get(image_id), False, inputs


def prune(client: Any, *, keep: str, name: str) -> list[str]:
    """Remove this name's other runtime images (shared layers stay); images in use are kept."""
    docker = dockerapi.docker_module()
    used = {c.image.id for c in client.containers.list(all=True) if c.image is not None}
    removed = []
    for image in client.images.list(name=name, filters={"label": f"{LABEL_KIND}=runtime"}):
        if image.id == keep or image.id in used:
            continue
        try:
            client.images.remove(image.id, force=False, noprune=False)
            removed.append(image.id)
        except docker.errors.APIError as exc:
            log(f"kept {image.id[:19]}: {exc.explanation or exc}")
    return removed


# ----------------------------------------------------------------------------- main

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n", maxsplit=1)[0])
    ap.add_argument("--base-only", action="store_true", help="build (or find) the base image only")
    ap.add_argument("--tag", default=DEFAULT_TAG, help="runtime image repository name (default %(default)s)")
    ap.add_argument("--base-tag", default=DEFAULT_BASE_TAG, help="base image repository name (default %(default)s)")
    ap.add_argument("--cache-dir", type=Path, default=None, help="debootstrap tarball and wheel cache")
    ap.add_argument("--criu", default=None, help="CRIU binary to bake in (default: the one on PATH)")
    ap.add_argument("--suite", default=None, help="Debian suite of the base (default: this host's)")
    ap.add_argument("--output", type=Path, default=None, help="also write the JSON result to this file")
    ap.add_argument("--engine", choices=sorted(ENGINE_KERNELS), default=None,
                    help="also build this engine's variant of the runtime image (tag: TAG-ENGINE)")
    ap.add_argument("--engine-python", default=None,
                    help="the engine environment's python (default: scripts/engine-env.sh ENGINE builds or finds it)")
    ap.add_argument("--prune", action="store_true",
                    help="remove older runtime images of this name that no container uses")
    args = ap.parse_args(argv)

    t_start = time.monotonic()
    timings: dict[str, float] = {}
    try:
        cache = args.cache_dir or default_cache_dir()
        cache.mkdir(parents=True, exist_ok=True)
        client = dockerapi.docker_client()
        suite = args.suite or host_suite()
        python = SUITE_PYTHON.get(suite)
        if python is None:
            raise ColdSnapError(f"Debian suite {suite!r} has no known python3 version here",
                                fix=f"use one of {', '.join(SUITE_PYTHON)}")
        arch = dpkg_arch()
        criu, criu_version = find_criu(args.criu)
        packages = sorted(set(BASE_EXTRA_PACKAGES) | set(library_packages(criu)))
        with file_lock(cache / "build.lock", timeout=3600):
            t0 = time.monotonic()
            base, base_cached = build_base(client, cache=cache, suite=suite, arch=arch, packages=packages,
                                           tag=args.base_tag, timings=timings)
            timings["base_s"] = round(time.monotonic() - t0, 2)
            result: dict[str, Any] = {
                "base_image": dockerapi.pinned_ref(args.base_tag, base.id), "base_image_id": base.id,
                "base_cached": base_cached, "base_size_bytes": int(base.attrs.get("Size") or 0),
                "suite": suite, "arch": arch, "criu_version": criu_version}
            if not args.base_only:
                t0 = time.monotonic()
                image, cached, inputs = runtime_build(client, base=base, cache=cache, criu=criu,
                                                      criu_version=criu_version, python=python, arch=arch,
                                                      tag=args.tag, timings=timings)
                timings["runtime_s"] = round(time.monotonic() - t0, 2)
                result.update({"runtime_image": dockerapi.pinned_ref(args.tag, image.id), "image_id": image.id,
                               "inputs": inputs, "cached": cached, "size_bytes": int(image.attrs.get("Size") or 0)})
                if args.prune:
                    result["pruned"] = prune(client, keep=image.id, name=args.tag)
                if args.engine:
                    # The engine's variant stands on a base with the engine's packages too, under the same
                    # runtime layer; then the engine environment on top.
                    t0 = time.monotonic()
                    steps: dict[str, float] = {}
                    ebase, _ecached = build_base(client, cache=cache, suite=suite, arch=arch,
                                                 packages=sorted(set(packages) | set(ENGINE_PACKAGES[args.engine])),
                                                 tag=args.base_tag, timings=steps)
                    eruntime, _rcached, _rinputs = runtime_build(
                        client, base=ebase, cache=cache, criu=criu, criu_version=criu_version, python=python,
                        arch=arch, tag=f"{args.tag}-{args.engine}-base", timings=steps)
                    timings.update({f"{args.engine}_{k}": v for k, v in steps.items()})
                    variant, vcached, vinputs = engine_build(client, runtime=eruntime, engine=args.engine,
                                                             python=python, engine_python=args.engine_python,
                                                             tag=f"{args.tag}-{args.engine}", timings=timings)
                    timings[f"{args.engine}_s"] = round(time.monotonic() - t0, 2)
                    result["engine_image"] = {
                        "engine": args.engine, "image": dockerapi.pinned_ref(f"{args.tag}-{args.engine}", variant.id),
                        "image_id": variant.id, "inputs": vinputs, "cached": vcached,
                        "size_bytes": int(variant.attrs.get("Size") or 0)}
    except ColdSnapError as exc:
        print(f"runtime_image/build.py: {exc}", file=sys.stderr)
        return 2
    except subprocess.CalledProcessError as exc:
        print(f"runtime_image/build.py: {exc}", file=sys.stderr)
        return 2
    timings["total_s"] = round(time.monotonic() - t_start, 2)
    result["timings"] = timings
    text = json.dumps(result, indent=2, sort_keys=True)
    if args.output:
        atomic_write_bytes(args.output, (text + "\n").encode())
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
