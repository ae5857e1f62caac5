"""Collectives across simulated hosts (network namespaces with their own
addresses and hostnames: pycomm/bench/simhosts.py), as a cluster user runs
them: torchrun's variables, MASTER_ADDR on the first host.

Skips, with the reason, where network namespaces are unavailable (not root,
no iproute2).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pycomm.bench import simhosts

_REASON = simhosts.unavailable_reason()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=str(_REASON))
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(layout: list[int], transport: str,
         extra_env: dict[str, str] | None = None) -> list[simhosts.RankResult]:
    env = {"PYTHONPATH": _ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": "1", **(extra_env or {})}
    with simhosts.SimulatedHosts(len(layout)) as hosts:
        results = hosts.launch(layout, [sys.executable, "-m", "tests._hosts_rank", transport],
                               env=env, timeout=240)
    for res in results:
        assert res.returncode == 0, (f"rank {res.rank} on host {res.host} exited "
                                     f"{res.returncode}:\n{res.stdout}\n{res.stderr[-4000:]}")
    return results


def _reported(results: list[simhosts.RankResult]) -> list[tuple[str, str]]:
    """(hostname, transport) each rank printed in its OK line."""
    lines = [next(ln for ln in r.stdout.splitlines() if ln.startswith("OK ")) for r in results]
    return [(ln.split()[2], ln.split()[3]) for ln in lines]


def test_hosts_are_separate_and_torn_down():
    with simhosts.SimulatedHosts(2) as hosts:
        names = hosts.namespaces + [hosts.switch]
        out = subprocess.run(hosts.command(1, ["sh", "-c", "hostname; getent hosts pycomm-host0"]),
                             capture_output=True, text=True, check=True).stdout.split()
        assert out[0] == "pycomm-host1" and out[1] == hosts.addresses[0]
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(n in listed for n in names)
    assert not any(os.path.exists(f"/etc/netns/{n}") for n in names)


def test_link_rate_caps_each_host_link():
    """link_rate puts a token bucket of that rate on every host's eth0 (what
    it sends) and on its port of the switch (what it receives), and tells
    the ranks."""
    with simhosts.SimulatedHosts(2, "200mbit") as hosts:
        for h in range(2):
            for ns, dev in ((hosts.namespaces[h], "eth0"), (hosts.switch, f"port{h}")):
                shown = subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "show", "dev", dev],
                                       capture_output=True, text=True, check=True).stdout
                assert "tbf" in shown and "rate 200Mbit" in shown, (ns, dev, shown)
        seen = hosts.launch([1, 1], ["sh", "-c", 'echo "$PYCOMM_SIM_LINK_RATE"'], timeout=60)
    assert [r.stdout.strip() for r in seen] == ["200mbit", "200mbit"]


# transport="auto" runs the flat ring on 3+1 and 2x1 too: those are slow variants here.
@pytest.mark.parametrize("layout", [[2, 2], pytest.param([3, 1], marks=pytest.mark.slow),
                                    pytest.param([1, 1], marks=pytest.mark.slow)],
                         ids=["2x2", "3+1", "2x1"])
def test_flat_gloo_across_hosts(layout):
    results = _run(layout, "gloo")
    assert [h for h, _ in _reported(results)] == [f"pycomm-host{h}" for h, k in enumerate(layout)
                                                  for _ in range(k)]
    assert {t for _, t in _reported(results)} == {"gloo"}


#: transport="auto": shm+gloo where every host has the same number >= 2 of
#: ranks, else the flat gloo ring (uneven hosts with a warning).
_AUTO = {"2x2": ([2, 2], "shm+gloo"), "3+1": ([3, 1], "gloo"), "2x1": ([1, 1], "gloo")}


@pytest.mark.parametrize("name", list(_AUTO))
def test_auto_across_hosts(name):
    layout, transport = _AUTO[name]
    results = _run(layout, "auto")
    assert {t for _, t in _reported(results)} == {transport}
    warned = ["runs the flat gloo ring across hosts" in r.stderr for r in results]
    assert all(warned) if name == "3+1" else not any(warned)
    if transport == "shm+gloo":  # the group with ranks alternating between hosts too
        assert all("interleaved group: shm+gloo" in r.stdout for r in results)


@pytest.mark.slow
def test_auto_across_hosts_checked_mode():
    """PYCOMM_CHECK=1: every sub-communicator of shm+gloo runs checked."""
    results = _run([2, 2], "auto", {"PYCOMM_CHECK": "1"})
    assert {t for _, t in _reported(results)} == {"shm+gloo"}


@pytest.mark.parametrize("ifname", ["", "eth0"], ids=["unset", "eth0"])
def test_loopback_hostname(ifname):
    """Each host's /etc/hosts maps every hostname to 127.0.1.1 (Debian's
    trap). Without GLOO_SOCKET_IFNAME that is a clear error on every rank,
    naming the fix, not a hang; with it, gloo binds to the interface and the
    hostnames do not matter."""
    with simhosts.SimulatedHosts(2) as hosts:
        for ns, name, addr in zip(hosts.namespaces, hosts.hostnames, hosts.addresses):
            path = f"/etc/netns/{ns}/hosts"
            with open(path) as f:
                text = f.read()
            with open(path, "w") as f:
                f.write(text.replace(f"{addr} {name}", f"127.0.1.1 {name}"))
        results = hosts.launch([1, 1], [sys.executable, "-m", "tests._hosts_rank", "auto"],
                               env={"PYTHONPATH": _ROOT, "GLOO_SOCKET_IFNAME": ifname},
                               timeout=120)
    for res in results:
        if ifname:
            assert res.returncode == 0, res.stderr[-2000:]
        else:
            assert res.returncode != 0
            assert "in /etc/hosts or DNS, or set GLOO_SOCKET_IFNAME" in res.stderr, \
                res.stderr[-2000:]


def test_backend_across_hosts():
    """The c10d backend across hosts: CPU allreduce composed by the shm+gloo
    communicator (sync, async, torch DDP), other ops on its flat gloo ring;
    destroy_process_group closes every part."""
    results = _run([2, 2], "backend")
    assert {t for _, t in _reported(results)} == {"shm+gloo"}


def test_no_shared_memory_on_one_host_falls_back_together():
    """Host 1 cannot set up shm: every rank (host 0's too) takes the flat
    gloo ring, with the warning naming why, rather than waiting for host 1."""
    results = _run([2, 2], "auto", {"PYCOMM_TEST_NO_SHM_ON_HOST": "1"})
    assert {t for _, t in _reported(results)} == {"gloo"}
    assert all("runs the flat gloo ring across hosts (host of rank" in r.stderr for r in results)


@pytest.mark.slow
def test_socket_bound_runs(tmp_path):
    """benchmarks/hosts/socket_bound.py: every series measured on 2x2 hosts
    (a smoke run; benchmarks measure, tests only check they run)."""
    out = tmp_path / "bound.json"
    res = subprocess.run([sys.executable, os.path.join(_ROOT, "benchmarks", "hosts",
                                                       "socket_bound.py"),
                          "--bytes", "1M", "--calls", "2", "--json", str(out)],
                         capture_output=True, text=True, timeout=240,
                         env={**os.environ, "PYTHONPATH": _ROOT})
    assert res.returncode == 0, res.stderr[-3000:]
    assert "most any all-reduce could gain over torch gloo here" in res.stdout
    import json
    data = json.loads(out.read_text())
    series = [k for k in data if k.endswith("_s")]
    assert len(series) == 9 and all(len(data[k]) == 2 for k in series), series
    assert set(data["cpu_busy"]) == set(series)


@pytest.mark.slow
def test_gloo_duplex_runs(tmp_path):
    """benchmarks/hosts/gloo_duplex.py: every series measured between 2
    shaped simulated hosts, its JSON written (a smoke run; benchmarks
    measure, tests only check they run); a bad rate fails at parsing."""
    script = os.path.join(_ROOT, "benchmarks", "hosts", "gloo_duplex.py")
    out = tmp_path / "duplex.json"
    res = subprocess.run([sys.executable, script, "--link-rate", "1gbit", "--mib", "1",
                          "--reps", "1", "--json", str(out)],
                         capture_output=True, text=True, timeout=240,
                         env={**os.environ, "PYTHONPATH": _ROOT})
    assert res.returncode == 0, res.stderr[-3000:]
    import json
    data = json.loads(out.read_text())
    assert set(data["median_ms"]) == {"one way", "gloo all_reduce", "both ways, 1 message(s)",
                                      "both ways, 4 message(s)", "both ways, 16 message(s)",
                                      "16 messages, sends 20 ms first",
                                      "16 messages, receives first",
                                      "1 message, send 20 ms first",
                                      "1 message, send 20 ms first, a group a direction"}
    assert all(t > 0 for t in data["median_ms"].values()) and data["link_ms"] > 0
    bad = subprocess.run([sys.executable, script, "--link-rate", "fast"], capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 2 and "link rate" in bad.stderr
