"""One rank of a simulated-hosts test (tests/test_hosts.py): runs every
collective against float64 references and prints one line,
``OK <rank> <hostname> <transport>``, or raises (non-zero exit).

Started by pycomm.bench.simhosts with torchrun's variables; argv[1] is the
transport to ask for ("auto", "gloo", ...).
"""

from __future__ import annotations

import socket
import sys

import torch

import pycomm
from tests.reference import assert_matches, rank_input, reference

SIZES = [0, 1, 7, 1021, 300_007]


def check_collectives(comm: pycomm.Communicator) -> None:
    r, n = comm.rank, comm.world_size
    for count in SIZES:
        for dtype, op in [(torch.float32, "sum"), (torch.float64, "avg"), (torch.int32, "max"),
                          (torch.bfloat16, "sum")]:
            inputs = [rank_input(q, count, dtype, op) for q in range(n)]
            t = inputs[r].clone()
            comm.all_reduce(t, op=op)
            assert_matches(t, reference(inputs, op), f"all_reduce {count} {dtype} {op}")
        inputs = [rank_input(q, count * n, torch.float32, "sum") for q in range(n)]
        out = torch.empty(count)
        comm.reduce_scatter(out, inputs[r])
        assert_matches(out, reference(inputs, "sum")[r * count:(r + 1) * count], f"reduce_scatter {count}")
        mine = rank_input(r, count, torch.float32, "sum")
        gathered = torch.empty(count * n)
        comm.all_gather(gathered, mine)
        expect = torch.cat([rank_input(q, count, torch.float32, "sum") for q in range(n)])
        assert torch.equal(gathered, expect), f"all_gather {count}"
        for src in range(n):
            want = rank_input(src, count, torch.float64, "sum")
            t = want.clone() if r == src else torch.zeros(count, dtype=torch.float64)
            comm.broadcast(t, src=src)
            assert torch.equal(t, want), f"broadcast {count} from {src}"
    # p2p both ways around the ring (crosses hosts at every host boundary)
    right, left = (r + 1) % n, (r - 1) % n
    for count in (1, 1021, 300_007):
        got = torch.empty(count)
        mine = rank_input(r, count, torch.float32, "sum")
        works = comm.batch_isend_irecv([pycomm.P2POp("isend", mine, right),
                                        pycomm.P2POp("irecv", got, left)])
        for w in works:
            w.wait()
        assert torch.equal(got, rank_input(left, count, torch.float32, "sum")), f"p2p {count}"
    comm.barrier()


def main() -> None:
    comm = pycomm.init(transport=sys.argv[1] if len(sys.argv) > 1 else "auto", timeout=60)
    check_collectives(comm)
    print(f"OK {comm.rank} {socket.gethostname()} {comm.transport}", flush=True)
    comm.close()


if __name__ == "__main__":
    main()
