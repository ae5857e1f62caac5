"""Several hosts simulated on one machine, for tests and the study.

Each host is a network namespace with an address of its own on a private
bridge, its own hostname (``unshare -u``) and an ``/etc/hosts`` that resolves
every host (``ip netns exec`` bind-mounts ``/etc/netns/<ns>/hosts`` over
``/etc/hosts`` in the processes it starts)::

      host 0 (ns ...h0)          host 1 (ns ...h1)         switch (ns ...sw)
    +------------------+      +------------------+      +-----------------+
    | eth0 10.77.0.1   |------| eth0 10.77.0.2   |------| br0 (bridge)    |
    | hostname h0      |      | hostname h1      |      | one veth a host |
    +------------------+      +------------------+      +-----------------+

The addresses exist only inside the namespaces created here, so they touch no
real network; ``destroy()`` (also on ``with`` exit) deletes the namespaces
and their files, and ``create()`` first removes any left behind by a process
that died. Ranks are started as torchrun would start them (RANK, WORLD_SIZE,
LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR = host 0's address,
MASTER_PORT), so ``pycomm.init()`` and ``init_process_group`` work unchanged.

With ``link_rate`` (e.g. ``"1gbit"``) each host's link carries at most that
many bits per second each way (``tc qdisc ... tbf`` on the host's ``eth0``
and on its port of the switch), so the bytes between hosts cost wire time as on a real
network, not only the CPU time of the kernel's veth; the ranks see the rate
in ``PYCOMM_SIM_LINK_RATE`` (the study records it).

Needs root and iproute2 (``ip netns``, ``tc`` for ``link_rate``) and
util-linux (``unshare``); ``unavailable_reason()`` says why not where they
are missing.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import IO

__all__ = ["RankResult", "SimulatedHosts", "parse_link_rate", "unavailable_reason"]

_PREFIX = "pycomm"
_SUBNET = "10.77.0"
_PORT = 29500  # free: host 0's namespace is new
_RATE = re.compile(r"(\d+(?:\.\d+)?)([kmgt]?)bit", re.IGNORECASE)
_RATE_SCALE = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def parse_link_rate(text: str) -> int:
    """Bits per second of a rate as ``tc`` writes it ("1gbit", "500mbit",
    "2.5Gbit"); raises ValueError for anything else or a rate under 1 kbit."""
    m = _RATE.fullmatch(text.strip())
    bits = float(m.group(1)) * _RATE_SCALE[m.group(2).lower()] if m else 0.0
    if bits < 1000:
        raise ValueError(f"a link rate is a number and a unit, at least 1kbit (e.g. 1gbit, "
                         f"500mbit), got {text!r}")
    return int(bits)


def unavailable_reason(link_rate: str | None = None) -> str | None:
    """None when simulated hosts (with ``link_rate``, shaped links) can be
    made here, else why not."""
    if sys.platform != "linux":
        return "simulated hosts need Linux network namespaces"
    if os.geteuid() != 0:
        return "simulated hosts need root (ip netns, unshare)"
    for tool in ("ip", "unshare", *(("tc",) if link_rate else ())):
        if shutil.which(tool) is None:
            return f"simulated hosts need the `{tool}` command"
    probe = f"{_PREFIX}{os.getpid()}probe"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


@dataclass
class RankResult:
    """What one rank's process left: its exit code (negative: the signal that
    ended it; None: killed at the timeout) and its output."""

    rank: int
    host: int
    returncode: int | None
    stdout: str
    stderr: str


class SimulatedHosts:
    """``n_hosts`` simulated hosts, created on ``with`` entry and torn down
    on exit (or by ``create()`` / ``destroy()``).

    Args:
        n_hosts: how many hosts (1 to 250).
        link_rate: None (the veth's own speed), or each host link's rate in
            bits per second as ``tc`` writes it ("1gbit").

    Example:
        >>> with SimulatedHosts(2) as hosts:
        ...     results = hosts.launch([2, 2], [sys.executable, "train.py"])
    """

    def __init__(self, n_hosts: int, link_rate: str | None = None) -> None:
        if not 1 <= n_hosts <= 250:
            raise ValueError(f"n_hosts must be in 1..250, got {n_hosts}")
        self.n_hosts = n_hosts
        self.link_rate = link_rate
        self._rate_bits = parse_link_rate(link_rate) if link_rate else 0
        tag = f"{_PREFIX}{os.getpid()}"
        self.namespaces = [f"{tag}h{i}" for i in range(n_hosts)]
        self.switch = f"{tag}sw"
        self.hostnames = [f"{_PREFIX}-host{i}" for i in range(n_hosts)]
        self.addresses = [f"{_SUBNET}.{i + 1}" for i in range(n_hosts)]
        self._created = False

    def __enter__(self) -> SimulatedHosts:
        self.create()
        return self

    def __exit__(self, *exc: object) -> None:
        self.destroy()

    def create(self) -> None:
        """Makes the namespaces, the bridge, the links and each host's
        /etc/hosts. Raises RuntimeError naming the command that failed."""
        reason = unavailable_reason(self.link_rate)
        if reason:
            raise RuntimeError(reason)
        _remove_stale()
        self._created = True
        try:
            self._build()
        except subprocess.CalledProcessError as e:
            self.destroy()
            raise RuntimeError(f"simulated hosts: `{' '.join(e.cmd)}` failed: {e.stderr.strip()}") from e

    def _build(self) -> None:
        _ip("netns", "add", self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        hosts = "127.0.0.1 localhost\n" + "".join(
            f"{a} {h}\n" for a, h in zip(self.addresses, self.hostnames))
        for i, ns in enumerate(self.namespaces):
            _ip("netns", "add", ns)
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", f"port{i}",
                "netns", self.switch)
            _ip("-n", ns, "addr", "add", f"{self.addresses[i]}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            if self.link_rate:  # what host i sends, and what the switch sends it
                self._shape(ns, "eth0")
                self._shape(self.switch, f"port{i}")
            _ip("-n", self.switch, "link", "set", f"port{i}", "master", "br0")
            _ip("-n", self.switch, "link", "set", f"port{i}", "up")
            os.makedirs(f"/etc/netns/{ns}", exist_ok=True)
            with open(f"/etc/netns/{ns}/hosts", "w") as f:
                f.write(hosts)

    def _shape(self, ns: str, dev: str) -> None:
        """Caps what ``dev`` in namespace ``ns`` sends at the link rate: a
        token bucket holding 4 ms of traffic (at least 64 KiB, a veth's
        largest segment), queueing up to 200 ms before it drops."""
        burst = max(64 * 1024, self._rate_bits // 8 // 250)
        _ip("netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate",
            f"{self._rate_bits}bit", "burst", str(burst), "latency", "200ms")

    def destroy(self) -> None:
        """Deletes the namespaces (their links go with them) and files."""
        if not self._created:
            return
        for ns in [*self.namespaces, self.switch]:
            _delete_namespace(ns)
        self._created = False

    def command(self, host: int, argv: Sequence[str]) -> list[str]:
        """``argv`` run on ``host``: inside its namespace, with its hostname."""
        return ["ip", "netns", "exec", self.namespaces[host], "unshare", "--uts", "--", "sh", "-c",
                'hostname "$0" && exec "$@"', self.hostnames[host], *argv]

    def launch(self, layout: Sequence[int], argv: Sequence[str], *,
               env: Mapping[str, str] | None = None, timeout: float = 300.0) -> list[RankResult]:
        """Runs ``argv`` as ``sum(layout)`` ranks, ``layout[h]`` of them on
        host ``h`` (ranks numbered host by host), with torchrun's variables.
        Waits for every rank; past ``timeout`` seconds kills them all (their
        returncode is then None). Returns one RankResult a rank."""
        if len(layout) > self.n_hosts or any(k < 1 for k in layout):
            raise ValueError(f"layout {list(layout)} needs 1+ ranks on each of at most "
                             f"{self.n_hosts} hosts")
        world = sum(layout)
        procs: list[tuple[int, int, subprocess.Popen, IO[str], IO[str]]] = []
        base = {**os.environ, **(env or {}), "WORLD_SIZE": str(world),
                "PYCOMM_SIM_LINK_RATE": self.link_rate or "",
                "MASTER_ADDR": self.addresses[0], "MASTER_PORT": str(_PORT),
                "GLOO_SOCKET_IFNAME": (env or {}).get("GLOO_SOCKET_IFNAME", "eth0")}
        rank = 0
        for host, local_world in enumerate(layout):
            for local in range(local_world):
                out: IO[str] = tempfile.TemporaryFile("w+")
                err: IO[str] = tempfile.TemporaryFile("w+")
                rank_env = {**base, "RANK": str(rank), "LOCAL_RANK": str(local),
                            "LOCAL_WORLD_SIZE": str(local_world), "GROUP_RANK": str(host)}
                p = subprocess.Popen(self.command(host, argv), env=rank_env, stdout=out,
                                     stderr=err, start_new_session=True)
                procs.append((rank, host, p, out, err))
                rank += 1
        deadline = time.monotonic() + timeout
        codes: list[int | None] = []
        for _, _, p, _, _ in procs:
            try:
                codes.append(p.wait(max(0.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                codes.append(None)
        results = []
        for (r, host, p, out, err), code in zip(procs, codes):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
            results.append(RankResult(r, host, code, _read(out), _read(err)))
        return results


def _read(f: IO[str]) -> str:
    f.seek(0)
    text = f.read()
    f.close()
    return text


def _delete_namespace(ns: str) -> None:
    # Processes still inside keep a namespace alive; kill them first.
    pids = _ip("netns", "pids", ns, check=False).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass
    _ip("netns", "del", ns, check=False)
    shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)


def _remove_stale() -> None:
    """Deletes namespaces that a dead process of ours left behind."""
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        m = re.match(rf"{_PREFIX}(\d+)(h\d+|sw|probe)\b", line)
        if not m:
            continue
        try:
            os.kill(int(m.group(1)), 0)
        except ProcessLookupError:
            _delete_namespace(m.group(0))
        except PermissionError:
            pass
