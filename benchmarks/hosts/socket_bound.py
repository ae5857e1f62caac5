"""The socket bound of an all-reduce across simulated hosts, beside torch
gloo's all-reduce, in one run on the same ranks.

An all-reduce between H hosts must move, per host, at least 2(H-1)/H times
the tensor out and as much in (a reduce-scatter then an all-gather between
hosts; the hierarchy in pycomm/_hierarchy.py moves exactly that). With L
ranks a host, each rank's share is 2(H-1)/H * B/L bytes each way. Here every
rank pushes that share through a plain TCP socket to its peer on the other
host while receiving as much (full duplex, all ranks at once, no reduction,
no shared-memory step): no all-reduce that crosses hosts with fewer bytes
can take less time on these hosts. torch gloo's all-reduce of the whole
tensor is timed in the same processes, so

    torch_time / socket_time

is the most any such all-reduce could gain over torch gloo here. On
simulated hosts the "network" is the same CPU cores copying through the
kernel, so this bound is CPU work, not link bandwidth.

    python benchmarks/hosts/socket_bound.py --bytes 16M --calls 20

(2 hosts x 2 ranks; root and ``ip netns``, as the simulated hosts need).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time

_PORT_BASE = 29700  # the peers' sockets, host 0's namespace: free there


def _size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1].upper()] if text[-1].upper() in units else int(text)


def _connect_peer(rank: int, local: int, local_world: int, host: int) -> socket.socket:
    """A TCP connection between this rank and the rank with the same local
    index on the other host (host 0 listens, host 1 connects)."""
    import torch.distributed as dist

    port = _PORT_BASE + local
    if host == 0:
        srv = socket.create_server(("0.0.0.0", port))
        dist.barrier()  # listening before the other host connects
        conn, _ = srv.accept()
        srv.close()
    else:
        dist.barrier()
        conn = socket.create_connection((os.environ["MASTER_ADDR"], port))
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return conn


def _exchange(conn: socket.socket, out: memoryview, into: memoryview) -> None:
    """Sends ``out`` while receiving ``into`` (full duplex)."""
    sender = threading.Thread(target=conn.sendall, args=(out,))
    sender.start()
    got = 0
    while got < len(into):
        got += conn.recv_into(into[got:])
    sender.join()


def _cpu_ticks() -> tuple[int, int]:
    """The machine's (busy, total) CPU ticks so far (/proc/stat: every core,
    every namespace)."""
    with open("/proc/stat") as f:
        ticks = [int(v) for v in f.readline().split()[1:]]
    idle = ticks[3] + ticks[4]  # idle + iowait
    return sum(ticks) - idle, sum(ticks)


BUSY: dict[str, float] = {}  # name -> the machine's busy fraction during its calls


def _timed(fn, calls: int, name: str = "") -> list[float]:
    """Seconds of each call, the slowest rank's, every call started together;
    records in BUSY how busy the machine's cores were during the calls."""
    import torch
    import torch.distributed as dist

    times, busy, total = [], 0, 0
    for _ in range(calls):
        dist.barrier()
        b0, t0_ticks = _cpu_ticks()
        t0 = time.perf_counter()
        fn()
        dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        b1, t1_ticks = _cpu_ticks()
        busy, total = busy + b1 - b0, total + t1_ticks - t0_ticks
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        times.append(dt.item())
    if name:  # NaN: calls too short for /proc/stat's ticks
        BUSY[name] = busy / total if total else float("nan")
    return times


def _pycomm_steps(x, calls: int) -> dict[str, list[float]]:
    """pycomm's all-reduce of ``x`` across the hosts ("shm+gloo"), and each
    of its steps alone (pycomm/_hierarchy.py): intra-host reduce-scatter (and
    the all-reduce it replaced), the inter-host all-reduce of this rank's
    shard, the intra-host all-gather; and the gloo transport's exchange of
    the shard (and of half of it) with the peer on the other host."""
    import torch

    import pycomm

    comm = pycomm.init()
    assert comm.transport == "shm+gloo", comm.transport
    h = comm._impl
    flat = x.view(-1)
    m = flat.numel() // h._n_local
    mine = flat[h._local * m:(h._local + 1) * m]
    sum_ = int(pycomm.ReduceOp.SUM)
    steps = {
        "pycomm_s": lambda: comm.all_reduce(x),
        "pycomm_intra_all_reduce_s": lambda: h.intra.all_reduce(flat, sum_, "auto", False),
        "pycomm_inter_all_reduce_s": lambda: h.inter.all_reduce(mine, sum_, "ring", False),
        "pycomm_intra_all_gather_s": lambda: h.intra.all_gather(flat[:m * h._n_local], mine,
                                                                "auto", False),
    }
    steps["pycomm_intra_reduce_scatter_s"] = lambda: h.intra.reduce_scatter(  # in place, as step 1
        mine, flat[:m * h._n_local], sum_, "auto", False)
    peer = 1 - h.inter.rank
    recv_buf = torch.empty_like(mine)
    steps["pycomm_inter_exchange_s"] = lambda: h.inter.batch_p2p(
        [(True, mine, peer, 0), (False, recv_buf, peer, 0)]).wait()
    steps["pycomm_inter_exchange_half_s"] = lambda: h.inter.batch_p2p(
        [(True, mine[:m // 2], peer, 0), (False, recv_buf[:m // 2], peer, 0)]).wait()
    out = {name: _timed(fn, 2) and _timed(fn, calls, name) for name, fn in steps.items()}
    comm.close()
    return out


def _rank(nbytes: int, calls: int) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    local, local_world = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    host, hosts = rank // local_world, world // local_world
    assert hosts == 2, "the socket bound pairs the ranks of 2 hosts"
    x = torch.ones(nbytes // 4)
    torch_s = _timed(lambda: dist.all_reduce(x), 2) and _timed(lambda: dist.all_reduce(x), calls,
                                                               "torch_gloo_s")
    pycomm_s = _pycomm_steps(x, calls)
    share = 2 * (hosts - 1) * nbytes // (hosts * local_world)
    out, into = bytearray(share), bytearray(share)
    conn = _connect_peer(rank, local, local_world, host)
    ex = lambda: _exchange(conn, memoryview(out), memoryview(into))  # noqa: E731
    socket_s = _timed(ex, 2) and _timed(ex, calls, "socket_s")
    conn.close()
    if rank == 0:
        print(json.dumps({"bytes": nbytes, "hosts": hosts, "ranks_per_host": local_world,
                          "share_bytes_each_way": share, "torch_gloo_s": torch_s,
                          "socket_s": socket_s, **pycomm_s, "cpu_busy": BUSY}))
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bytes", default="16M", help="tensor size (e.g. 16M)")
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--nproc", type=int, default=2, help="ranks a host")
    p.add_argument("--json", help="also write the result here")
    p.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    nbytes = _size(args.bytes)
    if args.rank:
        _rank(nbytes, args.calls)
        return
    from pycomm.bench.simhosts import SimulatedHosts

    with SimulatedHosts(2) as hosts:
        results = hosts.launch([args.nproc] * 2, [sys.executable, __file__, "--rank", "--bytes",
                                                  str(nbytes), "--calls", str(args.calls)],
                               env={"OMP_NUM_THREADS": "1"})
    for r in results:
        if r.returncode != 0:
            raise SystemExit(f"rank {r.rank} exited {r.returncode}:\n{r.stderr[-3000:]}")
    data = json.loads(results[0].stdout.strip().splitlines()[-1])
    data["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                    text=True, cwd=os.path.dirname(__file__)).stdout.strip()
    data["loadavg"] = os.getloadavg()
    t, s = statistics.median(data["torch_gloo_s"]), statistics.median(data["socket_s"])
    print(f"{nbytes} bytes, 2 hosts x {args.nproc} ranks, median of {args.calls} calls "
          f"(slowest rank each):")
    busy = data["cpu_busy"]
    print(f"  torch gloo all-reduce:                  {t * 1e3:8.2f} ms  "
          f"(cores busy {busy['torch_gloo_s']:.0%})")
    print(f"  sockets only, {data['share_bytes_each_way']} bytes each way a rank: "
          f"{s * 1e3:8.2f} ms  (cores busy {busy['socket_s']:.0%})")
    print(f"  most any all-reduce could gain over torch gloo here: {t / s:.2f}x")
    for key in [k for k in data if k.startswith("pycomm")]:
        ms = statistics.median(data[key]) * 1e3
        print(f"  {key[:-2]:<32} {ms:8.2f} ms  ({t * 1e3 / ms:.2f}x torch, "
              f"cores busy {busy[key]:.0%})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(data, f, indent=1)


if __name__ == "__main__":
    main()
