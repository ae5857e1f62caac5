"""Does a gloo pair move data both ways at once? Two simulated hosts, one
rank each, a shaped link (``--link-rate``): torch's gloo p2p sends a tensor
one way, then exchanges it both ways at once (``batch_isend_irecv``) as one
message and as k chunks posted together, and gloo's own all-reduce of it;
then 16 chunks with every send posted 20 ms before the receives, and with
the receives posted first; then one message each way, the send posted
20 ms before the receive, on one group and with a group per direction
(each rank sends on one group and receives on the other).

Full duplex, the exchange takes about the one-way time. Found while looking
for why pycomm's all-reduce across the simulated hosts takes 1.4-2x the
link's time for its bytes (benchmarks/compression/README.md). gloo sends a
message only once the receiver said it posted the receive, and that notice
travels on the same connection behind data already queued there: sends
posted before the receives hold back the notices, and the exchange runs at
about half duplex. With a connection per direction a rank writes only
notices on the connection its peer's data comes over: pycomm's gloo
transport sends its payloads so (csrc/torch/pg_transport.h).

    python benchmarks/hosts/gloo_duplex.py --link-rate 200mbit --json F

Needs root and ``ip netns`` / ``tc`` (pycomm/bench/simhosts.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CHUNKS = (1, 4, 16)


def _rank(nbytes: int, reps: int) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    me = dist.get_rank()
    peer = 1 - me
    send, recv = torch.ones(nbytes // 4), torch.empty(nbytes // 4)

    def exchange(k: int) -> None:
        ops = []
        for s, r in zip(send.chunk(k), recv.chunk(k)):
            ops += [dist.P2POp(dist.isend, s, peer), dist.P2POp(dist.irecv, r, peer)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    def one_way() -> None:
        if me == 0:
            dist.send(send, 1)
        else:
            dist.recv(recv, 0)

    series = {"one way": one_way, "gloo all_reduce": lambda: dist.all_reduce(send)}
    series.update({f"both ways, {k} message(s)": (lambda k=k: exchange(k)) for k in CHUNKS})

    def ordered(sends_first: bool) -> None:
        def sends() -> list:
            return [dist.isend(s, peer) for s in send.chunk(16)]

        def recvs() -> list:
            return [dist.irecv(r, peer) for r in recv.chunk(16)]

        first = sends() if sends_first else recvs()
        time.sleep(0.02)  # as a receive posted once its header arrived
        for work in first + (recvs() if sends_first else sends()):
            work.wait()

    series["16 messages, sends 20 ms first"] = lambda: ordered(True)
    series["16 messages, receives first"] = lambda: ordered(False)
    # groups of their own (connections of their own): rank 0 sends on the
    # first and receives on the second, rank 1 the other way round
    groups = [dist.new_group([0, 1], backend="gloo") for _ in range(2)]

    def send_first(outgoing: object, incoming: object) -> None:
        sent = dist.isend(send, peer, group=outgoing)
        time.sleep(0.02)  # as a receive posted once its header arrived
        received = dist.irecv(recv, peer, group=incoming)
        sent.wait()
        received.wait()

    series["1 message, send 20 ms first"] = lambda: send_first(None, None)
    series["1 message, send 20 ms first, a group a direction"] = lambda: send_first(
        groups[me], groups[peer])
    ms = {}
    for name, fn in series.items():
        fn()  # warm-up: connections and buffers
        times = []
        for _ in range(reps):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        ms[name] = statistics.median(times)
    if me == 0:
        print(json.dumps(ms))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--link-rate", default="200mbit", help="tc's units, e.g. 200mbit")
    ap.add_argument("--mib", type=int, default=16, help="tensor size")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", default=None)
    ap.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    nbytes = args.mib << 20
    if args.rank:
        _rank(nbytes, args.reps)
        return
    sys.path.insert(0, str(ROOT))
    from pycomm.bench.report import git_commit
    from pycomm.bench.simhosts import SimulatedHosts, parse_link_rate, unavailable_reason

    try:
        bits = parse_link_rate(args.link_rate)
    except ValueError as e:
        ap.error(str(e))
    why = unavailable_reason(args.link_rate)
    if why:
        ap.error(why)
    argv = [sys.executable, __file__, "--rank", "--mib", str(args.mib), "--reps", str(args.reps)]
    with SimulatedHosts(2, link_rate=args.link_rate) as hosts:
        results = hosts.launch([1, 1], argv, env={"PYTHONPATH": str(ROOT)}, timeout=900)
    for r in results:
        if r.returncode != 0:
            sys.exit(f"rank {r.rank} failed ({r.returncode}):\n{r.stderr[-3000:]}")
    ms = json.loads(results[0].stdout.strip().splitlines()[-1])
    link_ms = nbytes * 8 / bits * 1e3
    print(f"# {args.mib} MiB between 2 simulated hosts at {args.link_rate}: "
          f"{link_ms:.0f} ms of the link a direction; median of {args.reps}")
    for name, t in ms.items():
        print(f"{name:32s} {t:9.1f} ms  {t / link_ms:5.2f}x the link's time")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": " ".join(sys.argv), "commit": git_commit(),
                       "link_rate": args.link_rate, "bytes": nbytes, "link_ms": link_ms,
                       "median_ms": ms}, f, indent=1)
        print(f"# wrote {args.json}")


if __name__ == "__main__":
    main()
