"""Read and rewrite the TCP listeners recorded in a CRIU image directory.

A CRIU image file is two little-endian u32 magics followed by entries, each a
u32 length and a protobuf message. Open files, sockets among them, are the
``file_entry`` messages of ``files.img``; a TCP socket is one whose ``type`` is
``INETSK`` and whose ``isk`` (``inet_sk_entry``) carries ``state``,
``src_port`` and ``src_addr`` (one u32 per 4 address bytes, in memory order).
Field numbers follow CRIU's ``images/fdinfo.proto`` and ``images/sk-inet.proto``.

A restore onto other ports or addresses never edits the captured images: it
builds a sibling directory that links every image but ``files.img``, which is
written anew with only the listeners' ``src_port``/``src_addr`` changed (every
other byte of every entry is carried over as it was).
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import socket
import struct
from dataclasses import dataclass
from pathlib import Path

from ansible_collections.coldsnap.fleet.plugins.module_utils.process.criu import SHM_ARCHIVE

FILES_IMAGE = "files.img"

# fdinfo.proto: file_entry.type = 1, file_entry.isk = 4, fd_types.INETSK = 4
_FE_TYPE, _FE_ISK, _INETSK = 1, 4, 4
# sk-inet.proto: inet_sk_entry fields
_ISK_FAMILY, _ISK_TYPE, _ISK_STATE, _ISK_SRC_PORT, _ISK_SRC_ADDR = 3, 4, 6, 7, 11
_TCP_LISTEN = 10
_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5


class ImageError(ValueError):
    """An image that is not what CRIU writes."""


# ------------------------------------------------------------------ protobuf wire format
def _read_varint(buf: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(buf):
            raise ImageError("truncated varint")
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            raise ImageError("varint longer than 10 bytes")


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        b = value & 0x7F
        value >>= 7
        if value:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


@dataclass
class _Field:
    number: int
    wire: int
    value: int | bytes  # int for varints, the raw payload otherwise

    def encode(self) -> bytes:
        key = _varint((self.number << 3) | self.wire)
        if self.wire == _VARINT:
            return key + _varint(int(self.value))
        if self.wire == _LEN:
            return key + _varint(len(self.value)) + bytes(self.value)
        return key + bytes(self.value)


def _fields(buf: bytes) -> list[_Field]:
    out: list[_Field] = []
    pos = 0
    while pos < len(buf):
        key, pos = _read_varint(buf, pos)
        number, wire = key >> 3, key & 7
        if wire == _VARINT:
            value, pos = _read_varint(buf, pos)
            out.append(_Field(number, wire, value))
        elif wire == _LEN:
            size, pos = _read_varint(buf, pos)
            if pos + size > len(buf):
                raise ImageError("truncated length-delimited field")
            out.append(_Field(number, wire, buf[pos:pos + size]))
            pos += size
        elif wire in (_I64, _I32):
            width = 8 if wire == _I64 else 4
            out.append(_Field(number, wire, buf[pos:pos + width]))
            pos += width
        else:
            raise ImageError(f"unsupported protobuf wire type {wire}")
    return out


def _encode(fields: list[_Field]) -> bytes:
    return b"".join(f.encode() for f in fields)


def _first(fields: list[_Field], number: int) -> _Field | None:
    return next((f for f in fields if f.number == number), None)


def _uint32s(fields: list[_Field], number: int) -> list[int]:
    """A repeated uint32, packed or not."""
    out: list[int] = []
    for f in fields:
        if f.number != number:
            continue
        if f.wire == _VARINT:
            out.append(int(f.value))
        elif f.wire == _LEN:
            pos, buf = 0, bytes(f.value)
            while pos < len(buf):
                v, pos = _read_varint(buf, pos)
                out.append(v)
    return out


# ------------------------------------------------------------------ image files
def read_image(path: Path) -> tuple[bytes, list[bytes]]:
    """(magic header, entries) of one CRIU image file."""
    data = Path(path).read_bytes()
    if len(data) < 8:
        raise ImageError(f"{path}: shorter than a CRIU image header")
    head, pos, entries = data[:8], 8, []
    while pos < len(data):
        if pos + 4 > len(data):
            raise ImageError(f"{path}: truncated entry size at byte {pos}")
        (size,) = struct.unpack_from("<I", data, pos)
        pos += 4
        if pos + size > len(data):
            raise ImageError(f"{path}: entry at byte {pos - 4} runs past the end of the file")
        entries.append(data[pos:pos + size])
        pos += size
    return head, entries


def image_bytes(head: bytes, entries: list[bytes]) -> bytes:
    return head + b"".join(struct.pack("<I", len(e)) + e for e in entries)


# ------------------------------------------------------------------ process tree
PSTREE_IMAGE = "pstree.img"
_PS_PID, _PS_THREADS = 1, 5  # pstree.proto: pstree_entry.pid, pstree_entry.threads


def tree_ids(images_dir: Path) -> list[int]:
    """Every process and thread id of a dumped tree (from its ``pstree.img``): what CRIU restores, so what
    a restore needs free, including a thread or child that appeared after the tree was last looked at."""
    _head, entries = read_image(Path(images_dir) / PSTREE_IMAGE)
    out: set[int] = set()
    for entry in entries:
        fields = _fields(entry)
        out.update(_uint32s(fields, _PS_PID))
        out.update(_uint32s(fields, _PS_THREADS))
    return sorted(out)


# ------------------------------------------------------------------ listeners
def _address(words: list[int], family: int) -> str:
    raw = b"".join(struct.pack("<I", w) for w in words)
    if family == socket.AF_INET:
        return str(ipaddress.IPv4Address(raw[:4]))
    return str(ipaddress.IPv6Address(raw[:16].ljust(16, b"\0")))


def _words(address: str) -> list[int]:
    raw = ipaddress.ip_address(address).packed
    return [struct.unpack_from("<I", raw, i)[0] for i in range(0, len(raw), 4)]


@dataclass(frozen=True)
class Listener:
    """A listening TCP socket as CRIU recorded it."""

    family: int
    address: str
    port: int


def _tcp_socket(entry: bytes) -> tuple[list[_Field], list[_Field]] | None:
    """(file_entry fields, inet_sk_entry fields) of a TCP socket entry, else None."""
    fields = _fields(entry)
    typ = _first(fields, _FE_TYPE)
    isk = _first(fields, _FE_ISK)
    if typ is None or typ.value != _INETSK or isk is None:
        return None
    inner = _fields(bytes(isk.value))
    kind = _first(inner, _ISK_TYPE)
    if kind is None or kind.value != socket.SOCK_STREAM:
        return None
    return fields, inner


def _listener_of(inner: list[_Field]) -> Listener | None:
    state = _first(inner, _ISK_STATE)
    if state is None or state.value != _TCP_LISTEN:
        return None
    family = int(_first(inner, _ISK_FAMILY).value)
    port = int(_first(inner, _ISK_SRC_PORT).value)
    return Listener(family, _address(_uint32s(inner, _ISK_SRC_ADDR), family), port)


def listeners(images_dir: Path) -> list[Listener]:
    """The listening TCP sockets of a dumped tree (from its ``files.img``)."""
    _head, entries = read_image(Path(images_dir) / FILES_IMAGE)
    out = []
    for entry in entries:
        parts = _tcp_socket(entry)
        found = _listener_of(parts[1]) if parts else None
        if found is not None:
            out.append(found)
    return out


def _rebound(inner: list[_Field], family: int, address: str, port: int) -> list[_Field]:
    out: list[_Field] = []
    placed = False
    for f in inner:
        if f.number == _ISK_SRC_PORT:
            out.append(_Field(_ISK_SRC_PORT, _VARINT, port))
        elif f.number == _ISK_SRC_ADDR:
            if not placed:
                out += [_Field(_ISK_SRC_ADDR, _VARINT, w) for w in _words(address)]
                placed = True
        else:
            out.append(f)
    if ipaddress.ip_address(address).version != (4 if family == socket.AF_INET else 6):
        raise ImageError(f"cannot rebind a {'IPv4' if family == socket.AF_INET else 'IPv6'} listener to {address}")
    return out


def rebind_listeners(images_dir: Path, out_dir: Path, moves: dict[tuple[str, int], tuple[str, int]]) -> list[dict]:
    """Make ``out_dir`` a copy of ``images_dir`` whose TCP sockets bound to a key of ``moves``
    ((address, port) as recorded) are bound to its value instead: the listener and any closed
    connection of it. Images are hard-linked (symlinked across file systems); ``files.img`` is
    written anew. Returns ``[{"from": [addr, port], "to": [addr, port]}]`` per listener moved."""
    src, dst = Path(images_dir), Path(out_dir)
    head, entries = read_image(src / FILES_IMAGE)
    moved: list[dict] = []
    out_entries = []
    for entry in entries:
        parts = _tcp_socket(entry)
        if parts is None:
            out_entries.append(entry)
            continue
        fields, inner = parts
        family = int(_first(inner, _ISK_FAMILY).value)
        key = (_address(_uint32s(inner, _ISK_SRC_ADDR), family), int(_first(inner, _ISK_SRC_PORT).value))
        if key not in moves or moves[key] == key:
            out_entries.append(entry)
            continue
        addr, port = moves[key]
        new_inner = _encode(_rebound(inner, family, addr, port))
        out_entries.append(_encode([_Field(f.number, f.wire, new_inner) if f.number == _FE_ISK else f
                                    for f in fields]))
        if _listener_of(inner) is not None:
            moved.append({"from": list(key), "to": [addr, port]})
    if dst.is_symlink() or dst.is_file():
        dst.unlink()
    elif dst.exists():
        shutil.rmtree(dst)
    dst.mkdir(parents=True, mode=0o700)
    for item in src.iterdir():
        # Images (and the /dev/shm archive a restore unpacks from beside them) only: never a log or CRIU's
        # statistics (a restore writes those, and a hard link would write them into the captured state).
        wanted = item.name.endswith(".img") or item.name == SHM_ARCHIVE
        if item.name == FILES_IMAGE or not wanted or item.is_symlink() or not item.is_file():
            continue
        target = dst / item.name
        try:
            os.link(item, target)
        except OSError:
            target.symlink_to(item.absolute())
    tmp = dst / f".{FILES_IMAGE}.tmp"
    tmp.write_bytes(image_bytes(head, out_entries))
    os.replace(tmp, dst / FILES_IMAGE)
    return moved
