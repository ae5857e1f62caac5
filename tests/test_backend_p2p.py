"""Point-to-point matching through torch.distributed on backend="pycomm" and
through the Communicator, on the shm and gloo transports: tags (received out
of order, several interleaved with tag 0, sizes 0 / 1 / prime / larger than a
shm ring), receives from any source (dist.recv(t) with src=None, sourceRank),
a size mismatch (a clear error on both ranks, nothing corrupted) and a dead
sender (an error within the timeout, never a hang)."""

from __future__ import annotations

import os
import time
from datetime import timedelta

import pytest
import torch

from tests._dist import client_store, spawn_ranks

SIZES = [0, 1, 13, 1031, 700_001]  # 700_001 float32: 2.8 MB, more than a shm ring
TRANSPORTS = ["shm", "gloo"]


def _init(rank: int, world_size: int, port: int, transport: str, timeout_s: float = 60) -> None:
    import torch.distributed as dist

    import pycomm

    dist.init_process_group("pycomm", store=client_store(port, world_size), rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=timeout_s),
                            pg_options=pycomm.backend.Options(transport=transport))
    assert pycomm.backend.get_communicator().transport == transport


def _payload(sender: int, tag: int, count: int) -> torch.Tensor:
    """What ``sender`` sends with ``tag``: unique per (sender, tag)."""
    return torch.arange(count, dtype=torch.float32) + 1000.0 * tag + 100_000.0 * sender


def _tags(rank: int, world_size: int, port: int, transport: str) -> list:
    """Rank 0 sends one message per tag (tag t has size SIZES[t - 1]); rank 1
    receives them in the reverse order, blocking and asynchronously, then
    several tags interleaved with tag 0 (FIFO per tag), then a batch."""
    import torch.distributed as dist

    _init(rank, world_size, port, transport)
    try:
        tags = list(range(1, len(SIZES) + 1))
        if rank == 0:
            works = [dist.isend(_payload(0, t, SIZES[t - 1]), 1, tag=t) for t in tags]
            for w in works:
                w.wait()
        elif rank == 1:
            for t in reversed(tags):  # blocking, last sent first
                got = torch.full((SIZES[t - 1],), -1.0)
                dist.recv(got, 0, tag=t)
                assert torch.equal(got, _payload(0, t, SIZES[t - 1])), f"tag {t}"
        dist.barrier()

        # Interleaved: rank 0 sends tags 5, 0, 7, 5, 0, 7 (the k-th message of a
        # tag carries k); rank 1 posts its receives grouped by tag, 7s first.
        order = [5, 0, 7, 5, 0, 7]
        if rank == 0:
            seen: dict[int, int] = {}
            works = []
            for t in order:
                k = seen[t] = seen.get(t, 0) + 1
                works.append(dist.isend(_payload(0, t, 13) + k, 1, tag=t))
            for w in works:
                w.wait()
        elif rank == 1:
            posted = []
            for t in (7, 7, 0, 0, 5, 5):
                got = torch.empty(13)
                posted.append((t, got, dist.irecv(got, 0, tag=t)))
            counts: dict[int, int] = {}
            for t, got, w in posted:
                w.wait()
                k = counts[t] = counts.get(t, 0) + 1
                assert torch.equal(got, _payload(0, t, 13) + k), f"tag {t} message {k}"

        # batch_isend_irecv with a tag per op (torch's gloo-tags test): each
        # rank sends to every other rank with tag = its own rank, receives in
        # the opposite order of tags.
        ops, gots = [], {}
        for p in range(world_size):
            if p != rank:
                ops.append(dist.P2POp(dist.isend, _payload(rank, rank, 31), p, tag=rank))
        for p in reversed(range(world_size)):
            if p != rank:
                gots[p] = torch.empty(31)
                ops.append(dist.P2POp(dist.irecv, gots[p], p, tag=p))
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        for p, got in gots.items():
            assert torch.equal(got, _payload(p, p, 31)), f"batch from {p}"
        dist.barrier()
        return ["ok"]
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_tags_match_regardless_of_order(transport):
    assert spawn_ranks(_tags, 3, transport, timeout=240) == [["ok"]] * 3


def _any_source(rank: int, world_size: int, port: int, transport: str) -> list:
    """Rank 0 receives from any source, every other rank sends it its rank
    (count 1 + rank): dist.recv returns the sender, irecv's Work knows it.
    Then tagged: any source with tag 9 while tag-0 messages are in flight."""
    import torch.distributed as dist

    _init(rank, world_size, port, transport)
    try:
        senders = set(range(1, world_size))
        if rank == 0:
            seen = set()
            for _ in senders:
                got = torch.zeros(4)
                src = dist.recv(got)
                assert src in senders and src not in seen, src
                seen.add(src)
                assert torch.equal(got, _payload(src, 0, 4)), src
            assert seen == senders
        else:
            dist.send(_payload(rank, 0, 4), 0)
        dist.barrier()

        # Every sender sends a tag-0 message of the wrong size for the any-source
        # receives first: they must wait for their own tag.
        if rank == 0:
            works = []
            for _ in senders:
                got = torch.zeros(1031)
                works.append((got, dist.irecv(got, tag=9)))
            seen = set()
            for got, w in works:
                w.wait()
                src = w._source_rank()
                assert src in senders and src not in seen, src
                seen.add(src)
                assert torch.equal(got, _payload(src, 9, 1031)), src
            for p in senders:
                small = torch.zeros(2)
                dist.recv(small, p)
                assert torch.equal(small, _payload(p, 0, 2)), p
        else:
            w0 = dist.isend(_payload(rank, 0, 2), 0)
            dist.send(_payload(rank, 9, 1031), 0, tag=9)
            w0.wait()
        dist.barrier()
        return ["ok"]
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("world_size", [3, 4])
def test_recv_from_any_source(transport, world_size):
    assert spawn_ranks(_any_source, world_size, transport, timeout=240) == [["ok"]] * world_size


def _mismatch(rank: int, world_size: int, port: int, transport: str) -> list:
    """A tagged receive of 4 elements against a send of 5: the receiver names
    both sizes and the tag; the communicator is aborted on both ranks."""
    import torch.distributed as dist

    _init(rank, world_size, port, transport, timeout_s=30)
    errors = []
    try:
        if rank == 0:
            try:
                dist.send(torch.ones(5), 1, tag=3)
                dist.barrier()
            except RuntimeError as e:
                errors.append(str(e))
        else:
            got = torch.zeros(4)
            try:
                dist.recv(got, 0, tag=3)
            except RuntimeError as e:
                errors.append(str(e))
            assert torch.equal(got, torch.zeros(4)), "a failed receive wrote into the tensor"
        return errors
    finally:
        try:
            dist.destroy_process_group()
        except RuntimeError:
            pass


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_size_mismatch_is_a_clear_error(transport):
    sender, receiver = spawn_ranks(_mismatch, 2, transport, timeout=120)
    assert len(receiver) == 1 and \
        "expected a message of 16 bytes from rank 0 with tag 3 but it sent 20 bytes" in receiver[0]
    assert len(sender) == 1 and "aborted" in sender[0], sender


def _dead_sender(rank: int, world_size: int, port: int, transport: str) -> list:
    """Rank 1 dies without sending; rank 0's receive from any source (tagged
    and not) fails within the timeout."""
    import torch.distributed as dist

    _init(rank, world_size, port, transport, timeout_s=10)
    dist.barrier()
    if rank == 1:
        os._exit(0)
    start = time.monotonic()
    try:
        dist.recv(torch.zeros(3), tag=5)
    except RuntimeError as e:
        return [str(e), time.monotonic() - start]
    return ["no error", time.monotonic() - start]


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_dead_sender_fails_within_the_timeout(transport):
    out = spawn_ranks(_dead_sender, 2, transport, timeout=120)
    msg, took = out[0]
    assert msg != "no error" and took < 30, out


def _communicator(rank: int, world_size: int, port: int, transport: str) -> list:
    """The same matching through pycomm.Communicator (send/recv/isend/irecv
    with tag=, recv(src=None) returning the sender, P2POp(tag=))."""
    import pycomm

    comm = pycomm.init(rank=rank, world_size=world_size, store=client_store(port, world_size),
                       transport=transport, device="cpu")
    try:
        if rank == 0:
            works = [comm.isend(_payload(0, t, 13), 1, tag=t) for t in (4, 0, 2)]
            for w in works:
                w.wait()
        elif rank == 1:
            for t in (2, 4, 0):
                got = torch.empty(13)
                assert comm.recv(got, 0, tag=t) == 0
                assert torch.equal(got, _payload(0, t, 13)), t
        if rank == 0:
            seen = set()
            for _ in range(world_size - 1):
                got = torch.empty(7)
                src = comm.recv(got, tag=6)
                seen.add(src)
                assert torch.equal(got, _payload(src, 6, 7)), src
            assert seen == set(range(1, world_size))
        else:
            comm.send(_payload(rank, 6, 7), 0, tag=6)
        peer = 1 - rank if rank < 2 else None
        if peer is not None:
            got = torch.empty(5)
            ops = [pycomm.P2POp("irecv", got, peer, tag=8),
                   pycomm.P2POp("isend", _payload(rank, 8, 5), peer, tag=8)]
            for w in comm.batch_isend_irecv(ops):
                w.wait()
            assert torch.equal(got, _payload(peer, 8, 5))
        comm.barrier()
        return ["ok"]
    finally:
        comm.close()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_communicator_tags_and_any_source(transport):
    assert spawn_ranks(_communicator, 3, transport, timeout=240) == [["ok"]] * 3


def _nested_tagged(rank: int, world_size: int, port: int, transport: str) -> list:
    """PowerSGD's pattern with tags, around a ring of 3: an async all-reduce's
    callback issues another, whose callback sends two tagged messages to the
    right and waits for the left's in the other order, inside the callback
    (issue 41 saw such a wait time out on gloo; it has not come back)."""
    import pycomm

    store = client_store(port, world_size)
    comm = pycomm.init(rank=rank, world_size=world_size, store=store, transport=transport,
                       timeout=20, set_default=False)
    right, left = (rank + 1) % world_size, (rank - 1) % world_size
    try:
        def inner(f: torch.futures.Future) -> list:
            sends = [comm.isend(_payload(rank, 10 + k, 300), right, tag=10 + k) for k in range(2)]
            for k in (1, 0):
                got = torch.empty(300)
                comm.irecv(got, left, tag=10 + k).wait()
                assert torch.equal(got, _payload(left, 10 + k, 300)), k
            for w in sends:
                w.wait()
            return f.value()

        def outer(f: torch.futures.Future) -> list:
            work = comm.all_reduce(f.value()[0].clone(), async_op=True)
            return work.get_future().then(inner).wait()

        futures = [comm.all_reduce(torch.ones(100), async_op=True).get_future().then(outer)
                   for _ in range(10)]
        for fut in futures:
            assert torch.equal(fut.wait()[0], torch.full((100,), 9.0))
        return ["ok"]
    finally:
        comm.close()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_tagged_p2p_waited_in_nested_callbacks(transport):
    assert spawn_ranks(_nested_tagged, 3, transport, timeout=240) == [["ok"]] * 3


def _shuffled(rank: int, world_size: int, port: int, transport: str) -> list:
    """Every rank but 0 sends rank 0 a random stream of tagged messages (size
    and content a function of sender, tag and ordinal); rank 0 posts its
    receives in a random interleaving of the streams, then receives from any
    source with one tag: each sender's messages must arrive in order."""
    import random

    import torch.distributed as dist

    _init(rank, world_size, port, transport)
    try:
        tags = [0, 1, 2, 3, 1 << 30]
        sizes = [0, 1, 13, 1031, 70_001]

        def size(s: int, t: int, k: int) -> int:
            return sizes[(s + 3 * t + 7 * k) % len(sizes)]

        def message(s: int, t: int, k: int) -> torch.Tensor:
            return torch.arange(size(s, t, k), dtype=torch.float32) + 1e6 * s + 1e3 * (t % 97) + k

        streams = {s: random.Random(s).choices(tags, k=24) for s in range(1, world_size)}
        if rank == 0:
            tokens = [(s, t) for s, ts in streams.items() for t in ts]
            random.Random(7).shuffle(tokens)
            counts: dict[tuple[int, int], int] = {}
            posted = []
            for s, t in tokens:
                k = counts[s, t] = counts.get((s, t), 0) + 1
                got = torch.full((size(s, t, k),), -1.0)
                posted.append((s, t, k, got, dist.irecv(got, s, tag=t)))
            for s, t, k, got, w in posted:
                w.wait()
                assert torch.equal(got, message(s, t, k)), (s, t, k)
            # From any source, tag 5: each sender's ordinals must increase.
            last = dict.fromkeys(streams, 0)
            works = []
            for _ in range(6 * len(streams)):
                got = torch.empty(2)
                works.append((got, dist.irecv(got, tag=5)))
            for got, w in works:
                w.wait()
                s = w._source_rank()
                k = int(got[1].item())
                assert got[0].item() == s and k == last[s] + 1, (s, k, last)
                last[s] = k
        else:
            seen: dict[int, int] = {}
            works = []
            for t in streams[rank]:
                k = seen[t] = seen.get(t, 0) + 1
                works.append(dist.isend(message(rank, t, k), 0, tag=t))
            for k in range(1, 7):
                works.append(dist.isend(torch.tensor([float(rank), float(k)]), 0, tag=5))
            for w in works:
                w.wait()
        dist.barrier()
        return ["ok"]
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_random_interleavings_of_tagged_streams(transport):
    assert spawn_ranks(_shuffled, 4, transport, timeout=240) == [["ok"]] * 4
