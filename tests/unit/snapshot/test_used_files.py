"""The files a process tree maps or holds open (recorded at capture, checked before a restore)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from ansible_collections.coldsnap.fleet.plugins.module_utils.process import files

HOLDER = """
import mmap, sys, time
lib = open(sys.argv[1], "rb")
m = mmap.mmap(lib.fileno(), 0, prot=mmap.PROT_READ)
log = open(sys.argv[2], "a")
print("ready", flush=True)
time.sleep(60)
"""


def _files_used_by(script: str, *paths: Path) -> dict[str, dict]:
    """What ``files.tree_files`` records for a process running ``script`` over ``paths`` (once it says ready)."""
    proc = subprocess.Popen([sys.executable, "-c", script, *map(str, paths)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        return {f["path"]: f for f in files.tree_files(proc.pid)}
    finally:
        proc.kill()
        proc.wait()


def test_a_tree_records_mapped_and_open_files_and_a_host_missing_them_is_named(tmp_path: Path) -> None:
    lib = tmp_path / "kernel.so"
    lib.write_bytes(b"k" * 4096)
    log = tmp_path / "engine.log"
    used = _files_used_by(HOLDER, lib, log)
    assert used[str(lib)] == {"path": str(lib), "size": 4096, "append": False}
    assert used[str(log)]["append"] is True
    assert not any(p.startswith(("/proc/", "/dev/")) for p in used)
    recorded = [used[str(lib)], used[str(log)]]
    assert files.file_problems(recorded) == []
    log.write_text("grown since capture\n")  # append-only: CRIU does not check its size
    lib.write_bytes(b"k" * 100)
    assert files.file_problems(recorded) == [(str(lib), "100 bytes here, 4096 when captured")]
    lib.unlink()
    assert files.file_problems(recorded) == [(str(lib), "absent")]


def test_under_is_component_wise() -> None:
    assert files.under("/root/.cache/vllm/x.so", "/root/.cache/vllm")
    assert files.under("/root/.cache/vllm", "/root/.cache/vllm/")
    assert not files.under("/root/.cache/vllm2/x.so", "/root/.cache/vllm")


READ_WRITE_APPEND = """
import sys, time
journal = open(sys.argv[1], "a+")  # O_RDWR|O_APPEND: CRIU checks its size at restore
log = open(sys.argv[2], "a")       # O_WRONLY|O_APPEND: CRIU does not
print("ready", flush=True)
time.sleep(60)
"""


def test_a_file_open_for_reading_and_appending_is_size_checked_as_criu_does(tmp_path: Path) -> None:
    journal = tmp_path / "journal"
    journal.write_text("abc")
    log = tmp_path / "engine.log"
    used = _files_used_by(READ_WRITE_APPEND, journal, log)
    assert used[str(journal)]["append"] is False
    assert used[str(log)]["append"] is True
    journal.write_text("abc grown")
    log.write_text("grown")
    assert files.file_problems([used[str(journal)], used[str(log)]]) == [
        (str(journal), "9 bytes here, 3 when captured")]
