"""Hosts on this machine: Linux network namespaces, each with its own address, joined by one bridge.

Each "host" is a namespace with a veth interface on a bridge that lives in a
namespace of its own, so nothing outside changes. Processes started in a host
see only its loopback and its interface: torchrun's rendezvous, gloo and the
beacons go over the bridge exactly as between machines. The hosts share the file
system (the local store stands in for a shared bucket) and the process table.
Needs root and iproute2 (``available()``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class Host:
    namespace: str
    interface: str
    address: str
    name: str

    def command(self, argv: list[str], env: dict[str, str]) -> list[str]:
        """``argv`` run inside this host with ``env`` (and nothing else of the caller's environment)."""
        return ["ip", "netns", "exec", self.namespace, "env", "-i", *(f"{k}={v}" for k, v in env.items()), *argv]


def available() -> str | None:
    """None when namespaces can be made here; else why not."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2's ip is not installed"
    probe = f"tp{os.getpid() % 10_000_000}probe"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot make a network namespace: {made.stderr.strip()[:200]}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@contextlib.contextmanager
def hosts(count: int, subnet: str = "10.231.0", reach_from_here: bool = False) -> Iterator[list[Host]]:
    """``count`` hosts at {subnet}.1, .2, …, removed (with every process left in them) on exit.

    ``reach_from_here``: this machine's own namespace joins the bridge too, at {subnet}.254, as a cluster's
    head node would (its daemons and tools reach the hosts' addresses; the link goes with the switch)."""
    tag = f"tp{os.getpid() % 10_000_000}{subnet.split('.')[1]}"  # interface names: at most 15 characters
    switch = f"{tag}sw"
    made: list[str] = []
    links: list[str] = []  # made in this machine's namespace: each is deleted, wherever it ended up
    if reach_from_here:
        _drop_stale_link(f"{subnet}.254")
    try:
        _ip("netns", "add", switch)
        made.append(switch)
        _ip("-n", switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", switch, "link", "set", "br0", "up")
        out = []
        for i in range(count):
            ns, iface, port = f"{tag}h{i}", f"{tag}v{i}", f"{tag}p{i}"
            _ip("netns", "add", ns)
            made.append(ns)
            _ip("link", "add", iface, "type", "veth", "peer", "name", port)
            links.append(iface)
            _ip("link", "set", iface, "netns", ns)
            _ip("link", "set", port, "netns", switch)
            _ip("-n", switch, "link", "set", port, "master", "br0")
            _ip("-n", switch, "link", "set", port, "up")
            address = f"{subnet}.{i + 1}"
            _ip("-n", ns, "addr", "add", f"{address}/24", "dev", iface)
            _ip("-n", ns, "link", "set", iface, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            out.append(Host(ns, iface, address, f"host{i}"))
        if reach_from_here:
            here, port = f"{tag}v", f"{tag}p"
            _ip("link", "add", here, "type", "veth", "peer", "name", port)
            links.append(here)
            _ip("link", "set", port, "netns", switch)
            _ip("-n", switch, "link", "set", port, "master", "br0")
            _ip("-n", switch, "link", "set", port, "up")
            _ip("addr", "add", f"{subnet}.254/24", "dev", here)
            _ip("link", "set", here, "up")
        yield out
    finally:
        for ns in reversed(made):
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), 9)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        for link in links:  # gone with its peer's namespace, unless it never left this one
            subprocess.run(["ip", "link", "del", link], capture_output=True)


def _drop_stale_link(address: str) -> None:
    """A link of ours (``tp…``) a killed test run left holding ``address`` here: its route would shadow the new
    bridge's."""
    shown = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True).stdout
    for line in shown.splitlines():
        fields = line.split()
        if len(fields) > 3 and fields[3].startswith(f"{address}/") and fields[1].startswith("tp"):
            subprocess.run(["ip", "link", "del", fields[1].split("@")[0]], capture_output=True)
