"""Two 'hosts' on one machine for multi-host tests: each is a network namespace with its own
address on a bridge, a private mount of the ColdSnap state root, and an sshd that Ansible
reaches like any remote host. The filesystem (and so the model and the venv) is shared,
the pid namespace too; the state root and the network are not."""

from __future__ import annotations

import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

BRIDGE = "csmh0"
SUBNET = "10.77.0"


def sh(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, check=check)


@dataclass
class Host:
    name: str
    address: str
    netns: str
    sshd: subprocess.Popen | None = None


class NetnsHosts:
    """Create, describe (as an inventory) and tear down the hosts."""

    def __init__(self, work: Path, state_root: Path, names: tuple[str, ...] = ("hosta", "hostb")) -> None:
        self.work = work
        self.state_root = state_root
        self.hosts = [Host(n, f"{SUBNET}.{i + 1}", f"cs-{n}") for i, n in enumerate(names)]
        self.key = work / "id_ed25519"

    def up(self) -> NetnsHosts:
        self.down(quiet=True)
        self.work.mkdir(parents=True, exist_ok=True)
        sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(self.key))
        (self.work / "authorized_keys").write_text(Path(f"{self.key}.pub").read_text())
        os.chmod(self.work / "authorized_keys", 0o600)
        sh("ip", "link", "add", BRIDGE, "type", "bridge")
        sh("ip", "addr", "add", f"{SUBNET}.254/24", "dev", BRIDGE)
        sh("ip", "link", "set", BRIDGE, "up")
        # dockerd sets the FORWARD policy to DROP and bridged frames pass through iptables:
        # let traffic between our hosts through (removed again in down()).
        sh("iptables", "-I", "FORWARD", "-i", BRIDGE, "-o", BRIDGE, "-j", "ACCEPT", check=False)
        self.state_root.mkdir(parents=True, exist_ok=True)
        for h in self.hosts:
            sh("ip", "netns", "add", h.netns)
            sh("ip", "link", "add", f"v-{h.name}", "type", "veth", "peer", "name", "eth0", "netns", h.netns)
            sh("ip", "link", "set", f"v-{h.name}", "master", BRIDGE, "up")
            sh("ip", "-n", h.netns, "addr", "add", f"{h.address}/24", "dev", "eth0")
            sh("ip", "-n", h.netns, "link", "set", "eth0", "up")
            sh("ip", "-n", h.netns, "link", "set", "lo", "up")
            private = self.work / f"{h.name}-state"
            private.mkdir(exist_ok=True)
            hostkey = self.work / f"{h.name}-hostkey"
            sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(hostkey))
            conf = self.work / f"{h.name}-sshd.conf"
            conf.write_text("\n".join([
                f"ListenAddress {h.address}", "Port 22", f"HostKey {hostkey}", "PermitRootLogin prohibit-password",
                f"AuthorizedKeysFile {self.work}/authorized_keys", "StrictModes no", "UsePAM no",
                f"PidFile {self.work}/{h.name}-sshd.pid", "PasswordAuthentication no", "MaxStartups 100",
                "MaxSessions 100",
                # As on a stock host: Ansible moves files over SFTP (its piped fallback is slow).
                "Subsystem sftp internal-sftp", ""]))
            Path("/run/sshd").mkdir(exist_ok=True)
            # A private mount of the state root: each host has its own node cache and captures.
            script = (f"mount --make-rprivate / && mount --bind {private} {self.state_root} && "
                      f"exec /usr/sbin/sshd -D -e -f {conf}")
            h.sshd = subprocess.Popen(["ip", "netns", "exec", h.netns, "unshare", "--mount", "sh", "-c", script],
                                      stdout=subprocess.DEVNULL, stderr=open(self.work / f"{h.name}-sshd.log", "w"))
        for h in self.hosts:
            self._wait_ssh(h)
        return self

    def _wait_ssh(self, h: Host) -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            r = sh(*self.ssh_args(h), "true", check=False)
            if r.returncode == 0:
                return
            time.sleep(0.3)
        raise RuntimeError(f"sshd in {h.netns} did not come up: {(self.work / f'{h.name}-sshd.log').read_text()}")

    def ssh_args(self, h: Host) -> list[str]:
        return ["ssh", "-i", str(self.key), "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null",
                "-o", "BatchMode=yes", "-o", "LogLevel=ERROR", f"root@{h.address}"]

    def run_on(self, h: Host, command: str) -> subprocess.CompletedProcess:
        return sh(*self.ssh_args(h), command, check=False)

    def inventory(self, python: str) -> dict:
        hosts = {}
        for h in self.hosts:
            hosts[h.name] = {
                "ansible_host": h.address, "ansible_user": "root", "ansible_connection": "ssh",
                "ansible_ssh_private_key_file": str(self.key), "ansible_python_interpreter": python,
                "ansible_ssh_common_args": "-o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null",
            }
        return {"all": {"hosts": {"localhost": {"ansible_connection": "local", "ansible_python_interpreter": python},
                                  **hosts}}}

    def down(self, quiet: bool = False) -> None:
        for h in self.hosts:
            if h.sshd is not None:
                h.sshd.kill()
                h.sshd.wait()
            # Engines restored inside the host keep running in its network namespace: stop them.
            r = sh("ip", "netns", "pids", h.netns, check=False)
            for pid in r.stdout.split():
                try:
                    os.kill(int(pid), 9)
                except (ProcessLookupError, ValueError):
                    pass
            sh("ip", "netns", "del", h.netns, check=False)
            sh("ip", "link", "del", f"v-{h.name}", check=False)
        sh("ip", "link", "del", BRIDGE, check=False)
        while sh("iptables", "-D", "FORWARD", "-i", BRIDGE, "-o", BRIDGE, "-j", "ACCEPT", check=False).returncode == 0:
            pass
