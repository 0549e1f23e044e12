"""Distributed transport for tensor parallelism: torch.distributed (gloo on CPU,
NCCL on GPU) whose rendezvous store is the activation's CSKV coordinator.

Because the store is the coordinator, a restored process rebuilds its process
group with fresh endpoints simply by pointing at the new activation's coordinator
(``rebind``) and initialising a new generation; no captured socket is reused.
"""

from __future__ import annotations

import datetime
import os
import time

import torch
import torch.distributed as dist

TRANSPORT_ENV_PREFIXES = ("NCCL_", "GLOO_", "MASTER_", "UCX_", "TP_SOCKET_IFNAME")


def is_transport_env(name: str) -> bool:
    """Placement variables that may differ between capture and restore hosts."""
    return name.startswith(TRANSPORT_ENV_PREFIXES)


class CoordinatorStore(dist.Store):
    """torch.distributed Store over CSKV (one TCP connection per call, no background threads)."""

    def __init__(self, client, prefix: str, timeout_s: float = 300.0) -> None:
        super().__init__()
        self.client = client
        self.prefix = prefix
        self.timeout_s = timeout_s

    def _k(self, key: str) -> str:
        return self.prefix + key

    def set(self, key, value):
        self.client.set(self._k(key), bytes(value) if not isinstance(value, str) else value.encode())

    def get(self, key):
        return self.client.get(self._k(key), timeout=self.timeout_s)

    def add(self, key, value):
        return self.client.add(self._k(key), int(value))

    def wait(self, keys, timeout=None):
        secs = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else self.timeout_s
        for k in keys:
            self.client.get(self._k(k), timeout=secs)

    def check(self, keys):
        return all(self.client.try_get(self._k(k)) is not None for k in keys)

    def delete_key(self, key):
        return self.client.delete(self._k(key))

    def compare_set(self, key, expected, desired):
        # Used only by some backends' rendezvous; the coordinator has no CAS, so emulate the
        # common "set if absent" case atomically enough for one-writer keys.
        current = self.client.try_get(self._k(key))
        exp = expected if isinstance(expected, bytes) else bytes(expected)
        if (current is None and not exp) or current == exp:
            self.set(key, desired)
            return bytes(desired) if not isinstance(desired, str) else desired.encode()
        return current if current is not None else exp

    def num_keys(self):
        raise NotImplementedError("num_keys is not supported by the CSKV store")


class Transport:
    """The engine's process group, re-creatable after a snapshot."""

    def __init__(self, *, rank: int, world: int, device: str, endpoint_file: str | None, scope: str) -> None:
        self.rank = rank
        self.world = world
        self.device = device
        self.endpoint_file = endpoint_file
        self.scope = scope
        self.backend = "gloo" if device == "cpu" else "nccl"
        self.active = False
        self._store: CoordinatorStore | None = None

    def _client(self):
        from ansible_collections.coldsnap.fleet.plugins.module_utils.coord.client import CoordinatorClient

        return CoordinatorClient.from_file(self.endpoint_file)

    def init(self, generation: int) -> None:
        if self.world == 1:
            return
        if not self.endpoint_file:
            raise RuntimeError("tensor parallelism needs the coordinator endpoint (COLDSNAP_COORDINATOR)")
        store = CoordinatorStore(self._client(), prefix=f"transport/{generation}/")
        if self.backend == "nccl":
            # "cuda" means the unit's first visible device (the unit sets CUDA_VISIBLE_DEVICES).
            dev = torch.device(self.device)
            torch.cuda.set_device(dev.index if dev.index is not None else 0)
        dist.init_process_group(self.backend, store=store, rank=self.rank, world_size=self.world,
                                timeout=datetime.timedelta(seconds=300))
        # The process group holds only the C++ side of this Python store: keep the Python
        # object alive, or NCCL's lazy rendezvous (at the first collective) finds no methods.
        self._store = store
        self.active = True

    def rebind(self, endpoint_file: str, env: dict[str, str]) -> None:
        """Point at the restore activation's coordinator and apply the destination's transport env."""
        self.endpoint_file = endpoint_file
        for name in [n for n in os.environ if is_transport_env(n)]:
            if name not in env:
                del os.environ[name]
        os.environ.update(env)

    def release(self) -> None:
        if not self.active:
            return
        dist.barrier()
        dist.destroy_process_group()
        self._store = None
        self.active = False

    def all_reduce(self, x: torch.Tensor) -> None:
        dist.all_reduce(x)

    def _dev(self) -> str:
        return "cpu" if self.backend == "gloo" else self.device

    def broadcast_command(self, op: int, ids: list[int], max_tokens: int) -> None:
        header = torch.tensor([op, len(ids), max_tokens], dtype=torch.long, device=self._dev())
        dist.broadcast(header, 0)
        if ids:
            dist.broadcast(torch.tensor(ids, dtype=torch.long, device=self._dev()), 0)

    def recv_command(self) -> tuple[int, list[int], int]:
        header = torch.zeros(3, dtype=torch.long, device=self._dev())
        # An idle rank waits here until rank 0 sends the next command. Poll the collective
        # rather than block in it: a blocking wait (NCCL: a device synchronisation) holds the
        # GIL, and the rank's control API, which the activation runtime drives, would stall.
        # The poll backs off to 2 ms, so a long-idle rank costs little CPU and a command waits
        # at most that long.
        work = dist.broadcast(header, 0, async_op=True)
        delay = 5e-5
        while not work.is_completed():
            time.sleep(delay)
            delay = min(delay * 2, 0.002)
        work.wait()
        op, n, max_tokens = (int(v) for v in header.tolist())
        ids: list[int] = []
        if n:
            buf = torch.zeros(n, dtype=torch.long, device=self._dev())
            dist.broadcast(buf, 0)
            ids = [int(v) for v in buf.tolist()]
        return op, ids, max_tokens
