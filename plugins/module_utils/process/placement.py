"""Where a restored unit listens: the captured listeners moved to the restore's port and address.

A unit's serving port and address are placement, not identity: the restore
request may name others than the capture did. The move is one port shift for
every listener of the unit (the serving port, the engine's control listener,
anything else the tree listened on), ``restore port - captured port`` of the
unit's service (an internal listener that this shift would push past 65535 or below 1
wraps around within 1024..65535); only the service's own listener (the captured service address
and port) moves to the restore's address: the engine's control API and any other
internal listener keep theirs (loopback stays loopback, never exposed by a restore
onto ``0.0.0.0``). Units without a service keep their ports. The CRIU images are never edited: the restore rebinds a linked
copy (:func:`.criu_images.rebind_listeners`).
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from pathlib import Path

from ansible_collections.coldsnap.fleet.plugins.module_utils.common.errors import AdmissionError
from ansible_collections.coldsnap.fleet.plugins.module_utils.formats.engines import ENGINES, command_option
from ansible_collections.coldsnap.fleet.plugins.module_utils.process import criu_images

UNPRIVILEGED = 1024  # the first port an internal listener wraps to


@dataclass(frozen=True)
class Placement:
    """How one unit's captured listeners move on this restore."""

    port_shift: int = 0
    addresses: dict[str, str] = field(default_factory=dict)  # captured address -> restore address
    field_path: str = ""  # the request field that names the restore's port (for error messages)
    service_port: int | None = None  # the captured serving port: only its listener changes address

    @property
    def moves_anything(self) -> bool:
        return bool(self.port_shift) or any(a != b for a, b in self.addresses.items())

    def apply(self, address: str, port: int, *, unit: str = "") -> tuple[str, int]:
        new_port = port + self.port_shift
        serving = self.service_port is None or port == self.service_port
        if not serving and not 1 <= new_port <= 65535:
            # An internal listener (the engine's control API: a port the engine picked, never the user) that the
            # shift pushes out of range wraps around within the unprivileged ports, so any serving port can be
            # restored onto; the move stays one-to-one and is checked for holders like any other.
            new_port = UNPRIVILEGED + (new_port - UNPRIVILEGED) % (65536 - UNPRIVILEGED)
        if not 1 <= new_port <= 65535:
            where = f" ({self.field_path})" if self.field_path else ""
            raise AdmissionError(
                f"unit {unit}: the captured listener {address}:{port} would move to port {new_port}, out of range: "
                f"every listener of a unit moves by the serving port's shift ({self.port_shift:+d}){where}",
                fix="choose a serving port that keeps every captured listener of the unit within 1..65535")
        new_address = self.addresses.get(address, address) if serving else address
        if ipaddress.ip_address(new_address).version != ipaddress.ip_address(address).version:
            raise AdmissionError(
                f"unit {unit}: the captured listener {address}:{port} cannot move to {new_address} (another address "
                f"family){' (' + self.field_path.rsplit('.', 1)[0] + '.address)' if self.field_path else ''}",
                fix=f"restore onto an {'IPv4' if ':' not in address else 'IPv6'} address")
        return new_address, new_port

    def listeners(self, captured: list[tuple[str, int]], *, unit: str = "") -> list[tuple[str, int]]:
        moves = self.moves(captured, unit=unit)
        return [moves[(a, p)] for a, p in captured]

    def moves(self, captured: list[tuple[str, int]], *, unit: str = "") -> dict[tuple[str, int], tuple[str, int]]:
        moves = {(a, p): self.apply(a, p, unit=unit) for a, p in captured}
        landed: dict[int, int] = {}
        for (_address, port), (_to, new_port) in moves.items():
            if landed.setdefault(new_port, port) != port:  # a wrapped listener on another's port
                raise AdmissionError(
                    f"unit {unit}: the captured listeners on ports {landed[new_port]} and {port} would both move to "
                    f"port {new_port} ({self.field_path or 'the serving port'})",
                    fix="restore onto another serving port")
        return moves

    def to_json(self) -> dict:
        return {"port_shift": self.port_shift, "addresses": dict(self.addresses), "field": self.field_path,
                "service_port": self.service_port}

    @classmethod
    def from_json(cls, data: dict | None) -> Placement:
        data = data or {}
        port = data.get("service_port")
        return cls(port_shift=int(data.get("port_shift", 0)), addresses=dict(data.get("addresses") or {}),
                   field_path=str(data.get("field", "")), service_port=int(port) if port is not None else None)


def for_unit(captured_launch: dict, launch: dict, unit_id: str) -> Placement:
    """The placement of ``unit_id`` when the capture's ``launch`` is restored as ``launch``."""
    def service(lnch: dict) -> tuple[int, dict] | None:
        for i, s in enumerate(lnch["execution"]["services"]):
            if s["unit"] == unit_id:
                return i, s
        return None

    before, now = service(captured_launch), service(launch)
    if before is None or now is None:
        return Placement()
    i, svc = now
    old_addr, new_addr = _canonical(before[1].get("address", "127.0.0.1")), _canonical(svc.get("address", "127.0.0.1"))
    addresses = {old_addr: new_addr} if old_addr != new_addr else {}
    # The engine's bind flag says where the serving socket listens, which may be wider than where the service
    # is probed (bound to 0.0.0.0, probed at 127.0.0.1): a restore whose command binds elsewhere than the
    # captured one moves the serving listener there too, or it would keep listening where the capture did.
    bound, binds = _bind_address(captured_launch, unit_id, capture=True), _bind_address(launch, unit_id)
    if bound is not None and binds is not None:
        if bound != binds:
            addresses[bound] = binds
        else:
            # The command keeps its bind (0.0.0.0 stays every interface): a new probe address only says
            # where the service is asked, never narrows where it listens.
            addresses.pop(bound, None)
    return Placement(port_shift=svc["port"] - before[1]["port"], addresses=addresses,
                     field_path=f"$.launch.execution.services[{i}].port", service_port=before[1]["port"])


def _bind_address(launch: dict, unit_id: str, *, capture: bool = False) -> str | None:
    """The address the unit's command binds its serving socket to (``0.0.0.0`` for every interface); None when
    the command does not say (on a restore: where it was captured) or the engine has no such flag."""
    engine = ENGINES.get(launch.get("engine", ""))
    unit = next((u for u in launch.get("units", []) if u["id"] == unit_id), None)
    if engine is None or not engine.address_flag or unit is None:
        return None
    got = command_option(unit["command"], engine.address_flag)
    if got is None and capture:
        got = engine.default_address  # what the capture's engine bound without the flag
    if got is None:
        return None
    return _canonical(got) if got else "0.0.0.0"  # an empty bind address is every interface


def _canonical(address: str) -> str:
    """``address`` as CRIU's images and /proc name it (``FD00:0::5`` is ``fd00::5``): the moves are looked up
    by the recorded address, so another spelling of the same one would match none and move nothing."""
    try:
        return str(ipaddress.ip_address(address))
    except ValueError:
        return address


def rebind(images_dir: Path, out_dir: Path, placement: Placement, *, unit: str) -> tuple[Path, list[dict]]:
    """The image directory CRIU restores from: ``images_dir`` itself when nothing moves, else a
    rebound copy in ``out_dir``. Returns it with the listeners moved."""
    if not placement.moves_anything:
        return Path(images_dir), []
    captured = [(x.address, x.port) for x in criu_images.listeners(images_dir)]
    return Path(out_dir), criu_images.rebind_listeners(images_dir, out_dir, placement.moves(captured, unit=unit))
