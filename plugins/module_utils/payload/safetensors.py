"""A standard-library safetensors reader: header parsing and tensor slices as file byte ranges.

Layout: 8-byte little-endian header length N, N bytes of JSON
(``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``),
then the data; offsets are relative to the first data byte. Recovery needs
only byte ranges (the copy is dtype-agnostic), so nothing is decoded.
"""

from __future__ import annotations

import hashlib
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import (
    ColdSnapError,
    FormatError,
    IntegrityError,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.strictjson import (
    duplicates_of,
    strict_loads,
)
from ansible_collections.coldsnap.fleet.plugins.module_utils.payload.layout import DTYPE_SIZES, slice_geometry

MAX_HEADER = 100 << 20


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a safetensors file; ``begin``/``end`` are absolute file offsets."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


class SafetensorsFile:
    """An open safetensors file: validated header, tensor table, the fd to read from."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        try:
            # O_NONBLOCK: a named pipe planted under the file's name must not hang the open (fstat refuses it).
            self.fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        except FileNotFoundError:
            raise ColdSnapError(f"checkpoint file {self.path} does not exist",
                                fix="download the pinned model revision (recovery reads its safetensors files)") from None
        except OSError as exc:
            raise ColdSnapError(f"checkpoint file {self.path} cannot be opened: {exc.strerror or exc}",
                                fix="make the model's files readable by the user ColdSnap runs as") from None
        try:
            self._parse()
        except BaseException:
            os.close(self.fd)
            raise

    def _parse(self) -> None:
        st = os.fstat(self.fd)
        if not stat.S_ISREG(st.st_mode):
            raise IntegrityError(f"checkpoint file {self.path} is not a regular file", fix="point at the .safetensors file")
        self.size = st.st_size
        head = os.pread(self.fd, 8, 0)
        if len(head) != 8:
            raise IntegrityError(f"checkpoint file {self.path} is shorter than a safetensors header",
                                 fix="the download is incomplete; download it again")
        n = int.from_bytes(head, "little")
        if n > MAX_HEADER or 8 + n > self.size:
            raise IntegrityError(f"checkpoint file {self.path} declares a {n}-byte header in a {self.size}-byte file",
                                 fix="the file is not safetensors or is truncated; download it again")
        raw = os.pread(self.fd, n, 8)
        self.header_sha256 = "sha256:" + hashlib.sha256(head + raw).hexdigest()
        self.data_start = 8 + n
        try:
            doc = strict_loads(raw, document=f"safetensors header of {self.path}")
        except FormatError as exc:
            raise IntegrityError(str(exc).replace("\n", " "), fix="the file is damaged; download it again") from None
        if not isinstance(doc, dict) or duplicates_of(doc):
            raise IntegrityError(f"safetensors header of {self.path} is not one JSON object with unique names",
                                 fix="download the file again")
        data_len = self.size - self.data_start
        self.tensors: dict[str, TensorInfo] = {}
        for name, entry in doc.items():
            if name == "__metadata__":
                continue
            try:
                dtype = entry["dtype"]
                shape = tuple(entry["shape"])
                begin, end = entry["data_offsets"]
                if dtype not in DTYPE_SIZES or not all(isinstance(d, int) and d >= 0 for d in shape):
                    raise ValueError
                if not (isinstance(begin, int) and isinstance(end, int) and 0 <= begin <= end <= data_len):
                    raise ValueError
            except (KeyError, TypeError, ValueError):
                raise IntegrityError(f"tensor {name!r} in {self.path} has a malformed header entry",
                                     fix="download the file again") from None
            numel = 1
            for d in shape:
                numel *= d
            if end - begin != numel * DTYPE_SIZES[dtype]:
                raise IntegrityError(f"tensor {name!r} in {self.path} holds {end - begin} bytes, its dtype and shape "
                                     f"need {numel * DTYPE_SIZES[dtype]}", fix="download the file again")
            self.tensors[name] = TensorInfo(name, dtype, shape, self.data_start + begin, self.data_start + end)

    def tensor(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise IntegrityError(f"checkpoint file {self.path} has no tensor {name!r}",
                                 fix="the checkpoint is not the pinned revision the replay plan was recorded for") from None

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def slice_ranges(info: TensorInfo, sl: tuple[int, int, int] | None) -> list[tuple[int, int]]:
    """File byte ranges ``(offset, size)`` whose concatenation is the row-major slice of the tensor.

    A slice along dim ``d`` is one run per index of the dims before ``d``;
    adjacent runs are merged, so a dim-0 slice is one range.
    """
    outer, row, start, total = slice_geometry(info.dtype, info.shape, sl)
    if total == 0:
        return []
    if sl is None:
        return [(info.begin, total)]
    run = total // outer
    out: list[tuple[int, int]] = []
    for i in range(outer):
        off = info.begin + i * row + start
        if out and out[-1][0] + out[-1][1] == off:
            out[-1] = (out[-1][0], out[-1][1] + run)
        else:
            out.append((off, run))
    return out


def write_safetensors(path: Path, tensors: dict[str, tuple[str, tuple[int, ...], bytes]],
                      metadata: dict[str, str] | None = None) -> None:
    """Write a safetensors file from raw tensor bytes (tests, benchmarks and the reference engine's fixtures)."""
    import json

    header: dict = {}
    if metadata:
        header["__metadata__"] = metadata
    pos = 0
    for name, (dtype, shape, data) in tensors.items():
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [pos, pos + len(data)]}
        pos += len(data)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # keep the data 8-byte aligned, as the reference writer does
    with open(path, "wb") as fh:
        fh.write(len(raw).to_bytes(8, "little"))
        fh.write(raw)
        for _dtype, _shape, data in tensors.values():
            fh.write(data)
