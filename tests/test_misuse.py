"""Misuse on default settings (no checked mode): mismatched calls across ranks
raise CommError on every rank, naming the op, the ranks and what differs;
nothing crashes (gloo used to SIGABRT), hangs or silently corrupts; the
communicator is then marked failed and says so.

Each case runs on a fresh communicator (a mismatch fails it), all cases of a
transport in one set of spawned ranks (spawning costs seconds a process).
"""

from __future__ import annotations

import os
import time
from datetime import timedelta

import pytest
import torch

from tests._dist import client_store, run_ranks, spawn_ranks

COMM_TIMEOUT_S = 10.0


def _cases(transport):
    """(name, call(comm), fragments every rank's error must contain, or that
    at least one rank's must where peers may learn of it only through the
    abort)."""
    def count(c):
        c.all_reduce(torch.ones(4 + (c.rank == 1)))

    def count_big(c):  # crosses a 256 KiB direct piece on one rank only
        c.all_reduce(torch.ones(65536 + (c.rank == 1)))

    def dtype(c):
        c.all_reduce(torch.ones(8, dtype=torch.float64 if c.rank == 1 else torch.float32))

    def op(c):
        c.all_reduce(torch.ones(8), op="max" if c.rank == 1 else "sum")

    def ring_count(c):
        c.all_reduce(torch.ones(4 + (c.rank == 1)), algo="ring")

    def both_roots(c):
        c.broadcast(torch.ones(8), src=1 if c.rank == 1 else 0)
        c.all_reduce(torch.ones(8))

    def skipped(c):
        if c.rank != 1:
            c.all_reduce(torch.ones(8))
        c.barrier()

    def algo(c):
        c.all_reduce(torch.ones(1024), algo="ring" if c.rank == 1 else "auto")

    def p2p_sizes(c, n_send, n_recv):
        if c.rank == 0:
            c.send(torch.ones(n_send), 1)
        elif c.rank == 1:
            c.recv(torch.empty(n_recv), 0)
        c.barrier()

    cases = [
        ("count", count, ["count differs", "all_reduce #1"]),
        ("count across pieces", count_big, ["count differs", "65537"]),
        ("dtype", dtype, ["dtype differs", "float32", "float64"]),
        ("reduce op", op, ["reduce op differs", "sum", "max"]),
        ("ring count", ring_count, ["count differs", "algo=ring"]),
        ("both roots", both_roots, ["root"]),
        ("skipped call", skipped, ["collective differs", "barrier", "all_reduce"]),
        ("p2p big into small", lambda c: p2p_sizes(c, 8, 4),
         ["expected a message of 16 bytes", "sent 32 bytes"]),
        ("p2p 0 vs 3", lambda c: p2p_sizes(c, 0, 3),
         ["expected a message of 12 bytes", "sent 0 bytes"]),
        # on gloo a payload above the header frame, taken into scratch
        # before the error
        ("p2p big payload", lambda c: p2p_sizes(c, 262_145, 262_144),
         ["expected a message of 1048576 bytes", "sent 1048580 bytes"]),
    ]
    if transport == "shm":
        # gloo runs the ring for both
        cases.append(("algo", algo, ["algo differs", "ring", "direct"]))
    return cases


# gloo: a rank blocked *sending* to the rank that failed (gloo sends wait for
# the matching receive) learns of it only from its timeout or the failed
# rank's exit; these cases allow that many ranks a plain CommError.
_MAY_NOT_NAME = {("gloo", "both roots"): 3, ("gloo", "p2p big into small"): 1,
                 ("gloo", "p2p 0 vs 3"): 1, ("gloo", "p2p big payload"): 1}


def _run_cases(rank, world_size, port, transport):
    import pycomm

    out = []
    for name, call, _ in _cases(transport):
        comm = pycomm.init(rank=rank, world_size=world_size, store=client_store(port, world_size),
                           transport=transport, timeout=timedelta(seconds=COMM_TIMEOUT_S))
        err = None
        try:
            call(comm)
        except pycomm.CommError as e:
            err = str(e)
        except Exception as e:  # noqa: BLE001 - reported, the test fails on it
            err = f"WRONG TYPE {type(e).__name__}: {e}"
        after = None
        if err is not None:
            # marked failed, and says so
            try:
                comm.all_reduce(torch.ones(2))
                after = "a later all_reduce succeeded"
            except pycomm.CommError as e:
                after = str(e)
        comm.close()
        out.append((name, err, after))
    return out


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("transport", ["shm", "gloo"])
def test_mismatches_raise_on_every_rank(transport, world_size):
    results = spawn_ranks(_run_cases, world_size, transport, timeout=600)
    problems = []
    for i, (name, _, fragments) in enumerate(_cases(transport)):
        errs = [results[r][i][1] for r in range(world_size)]
        afters = [results[r][i][2] for r in range(world_size)]
        for r, (e, a) in enumerate(zip(errs, afters)):
            if e is None:
                problems.append(f"{name}: rank {r} raised nothing")
                continue
            if e.startswith("WRONG TYPE"):
                problems.append(f"{name}: rank {r}: {e}")
            if "aborted" not in a:
                problems.append(f"{name}: rank {r}: later call gave {a!r}")
        informed = [e for e in errs if e and all(f in e for f in fragments)]
        need = max(0, world_size - _MAY_NOT_NAME.get((transport, name), 0))
        if len(informed) < need:
            problems.append(f"{name}: {len(informed)} of {world_size} ranks name what differs "
                            f"({fragments}): {errs}")
    assert not problems, "\n".join(problems)


def _tunable(rank, world_size, port, check):
    import pycomm

    # PYCOMM_DIRECT_MAX_BYTES differs: rank 1 runs the ring where rank 0 runs direct
    if rank == 1:
        os.environ["PYCOMM_DIRECT_MAX_BYTES"] = "0"
    comm = pycomm.init(rank=rank, world_size=world_size, store=client_store(port, world_size),
                       transport="shm", timeout=timedelta(seconds=COMM_TIMEOUT_S), check=check)
    try:
        comm.all_reduce(torch.ones(1024))
    except (ValueError, pycomm.CommError) as e:
        return type(e).__name__, str(e)
    finally:
        comm.close()
    return None, None


@pytest.mark.parametrize("check", [False, True])
def test_tunable_mismatch(check):
    """Default: the op header's algo differs (CommError). Checked mode: the
    fingerprint names the tunable (ValueError, before any payload moved)."""
    res = spawn_ranks(_tunable, 2, check, timeout=300)
    for kind, msg in res:
        assert kind == ("ValueError" if check else "CommError"), res
        assert "ring" in msg and "direct" in msg, msg
        if check:
            assert "PYCOMM_DIRECT_MAX_BYTES=0" in msg and "PYCOMM_DIRECT_MAX_BYTES=unset" in msg


def _interrupted(rank, world_size, port, transport):
    import signal
    import threading
    import time

    import pycomm

    # A timeout far beyond the interrupt: a rank that ignored SIGINT would
    # raise CommError (timeout), not KeyboardInterrupt.
    comm = pycomm.init(rank=rank, world_size=world_size, store=client_store(port, world_size),
                       transport=transport, timeout=timedelta(seconds=60))
    comm.barrier()
    out = {}
    if rank == 0:
        # Ctrl-C while blocked in a collective that rank 1 never joins
        sent = []
        timer = threading.Timer(1.0, lambda: (sent.append(time.monotonic()),
                                              os.kill(os.getpid(), signal.SIGINT)))
        timer.start()
        try:
            comm.all_reduce(torch.ones(1024))
            out["raised"] = None
        except KeyboardInterrupt as e:
            out["raised"] = "KeyboardInterrupt"
            out["after_signal_s"] = time.monotonic() - sent[0]
            out["msg"] = str(e)
        timer.join()
    else:
        try:
            comm.recv(torch.empty(4), 0)  # blocked on rank 0, which never sends
            out["raised"] = None
        except pycomm.CommError as e:
            out["raised"] = "CommError"
            out["msg"] = str(e)
    try:
        comm.barrier()
        out["later"] = "succeeded"
    except pycomm.CommError as e:
        out["later"] = str(e)
    comm.close()
    return out


@pytest.mark.parametrize("transport", ["shm", "gloo"])
def test_sigint_interrupts_blocked_collective(transport):
    """SIGINT on a rank blocked in a collective raises KeyboardInterrupt there
    (checked every 20 ms, not after the 60 s timeout); the peer blocked on it
    gets CommError saying it was interrupted; both communicators are failed."""
    r0, r1 = spawn_ranks(_interrupted, 2, transport, timeout=300)
    assert r0["raised"] == "KeyboardInterrupt", r0
    print(f"\n[sigint] {transport}: KeyboardInterrupt {r0['after_signal_s']:.2f} s after SIGINT")
    assert r1["raised"] == "CommError" and "interrupted" in r1["msg"], r1
    assert "aborted" in r0["later"] and "aborted" in r1["later"], (r0, r1)


def _second_thread(comm, key):
    import threading
    import time

    out = {}
    if comm.rank == 0:
        t = torch.empty(4)
        inside = threading.Event()

        def blocked_recv():
            inside.set()
            comm.recv(t, 1)  # blocks until rank 1 sends, after the probe below

        a = threading.Thread(target=blocked_recv)
        a.start()
        inside.wait()
        time.sleep(0.2)  # let thread a get into recv (it blocks there until rank 1 sends)
        try:
            comm.all_reduce(torch.ones(3))
            out["second"] = "accepted"
        except RuntimeError as e:
            out["second"] = str(e)
        comm._store.set(key, "probed")
        a.join()
        out["recv"] = t.tolist()
    else:
        comm._store.wait([key])
        comm.send(torch.arange(4.0), 0)
    # one after the other from another thread: fine
    res = []
    th = __import__("threading").Thread(target=lambda: res.append(comm.all_reduce(torch.ones(2))))
    th.start()
    th.join()
    t = torch.ones(2)
    comm.all_reduce(t)
    out["after"] = t.tolist()
    return out


def test_concurrent_calls_from_two_threads_are_rejected(transport):
    import uuid

    r0, r1 = run_ranks(_second_thread, 2, transport, f"thread-{uuid.uuid4().hex}")
    assert "another thread is inside a call" in r0["second"], r0
    assert r0["recv"] == [0.0, 1.0, 2.0, 3.0]
    assert r0["after"] == r1["after"] == [2.0, 2.0]


def _set_result_on_pending(comm, key):
    out = {}
    if comm.rank == 0:
        w = comm.irecv(torch.empty(3), 1)
        mine = [torch.full((1,), 7.0)]
        w.get_future().set_result(mine)  # the user completes it first
        comm._store.set(key, "set")
        out["value"] = w.get_future().value()[0].tolist()
    else:
        comm._store.wait([key])
        comm.send(torch.ones(3), 0)
    t = torch.ones(2)
    comm.all_reduce(t)  # the op completed underneath without killing the process
    out["after"] = t.tolist()
    return out


def test_set_result_on_a_pending_op_does_not_abort(transport):
    import uuid

    r0, r1 = run_ranks(_set_result_on_pending, 2, transport, f"setres-{uuid.uuid4().hex}")
    assert r0["value"] == [7.0]
    assert r0["after"] == r1["after"] == [2.0, 2.0]


def _auto_fallback(rank, world_size, port):
    import warnings

    import pycomm

    # a segment far larger than /dev/shm: the shm transport cannot be set up
    os.environ["PYCOMM_SHM_SLOT_BYTES"] = str(1 << 40)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        comm = pycomm.init(rank=rank, world_size=world_size,
                           store=client_store(port, world_size), transport="auto")
        comm2 = pycomm.init(rank=rank, world_size=world_size,
                            store=client_store(port, world_size), transport="auto")
    t = torch.ones(2)
    comm.all_reduce(t)
    transports = (comm.transport, comm2.transport)
    comm2.close()
    comm.close()
    return transports, [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]


def test_auto_fallback_to_gloo_warns_once_with_the_reason():
    for transports, warned in spawn_ranks(_auto_fallback, 2, timeout=300):
        assert transports == ("gloo", "gloo")
        assert len(warned) == 1, warned
        assert "uses gloo instead of shm" in warned[0] and "shm transport" in warned[0], warned


@pytest.mark.parametrize("env, fragment", [
    ({"RANK": "abc", "WORLD_SIZE": "2"}, "RANK='abc' is not an integer rank"),
    ({"RANK": "2", "WORLD_SIZE": "2"}, "rank=2 is out of range for world_size 2"),
    ({"PYCOMM_TIMEOUT": "abc"}, "PYCOMM_TIMEOUT='abc' is not a number of seconds"),
    ({"PYCOMM_TIMEOUT": "0"}, "PYCOMM_TIMEOUT=0.0 must be positive"),
    ({"PYCOMM_SLICE_BYTES": "4K"}, "PYCOMM_SLICE_BYTES='4K' is not a whole number of bytes"),
])
def test_environment_errors_name_the_variable(monkeypatch, env, fragment):
    import pycomm

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    kwargs = {} if "RANK" in env else {"rank": 0, "world_size": 1,
                                       "store": torch.distributed.HashStore()}
    with pytest.raises(ValueError, match=fragment.replace("(", r"\(")):
        pycomm.init(**kwargs)


def _pending_irecv_then_collective(comm):
    # rank 1 joins the all_reduce only after its send completed, while rank 0
    # has the matching irecv pending and already blocks in the all_reduce:
    # the pending receive must progress on its own (gloo: its payload is
    # posted once its header arrives, in the background)
    got = torch.empty(3)
    if comm.rank == 0:
        w = comm.irecv(got, 1)
    else:
        comm.send(torch.arange(3.0), 0)
    t = torch.ones(2)
    comm.all_reduce(t)
    if comm.rank == 0:
        w.wait()
        return got.tolist(), t.tolist()
    return None, t.tolist()


def test_pending_irecv_progresses_during_a_collective(transport):
    (got, t0), (_, t1) = run_ranks(_pending_irecv_then_collective, 2, transport)
    assert got == [0.0, 1.0, 2.0] and t0 == t1 == [2.0, 2.0]


def _close_after_failures(rank, world_size, port, transport):
    """Three communicators, each failed by mismatched counts (all ranks
    raise): nobody waits for the failed async op / the failure was raised by
    a synchronous call / the user aborted. What close() says in each case."""
    import pycomm

    out = {}
    for case in ("unseen", "seen", "aborted"):
        comm = pycomm.init(rank=rank, world_size=world_size,
                           store=client_store(port, world_size),
                           transport=transport, timeout=timedelta(seconds=COMM_TIMEOUT_S))
        t = torch.ones(4 + rank)
        if case == "unseen":
            w = comm.all_reduce(t, async_op=True)
            while not w.is_completed():  # fails on the worker; never wait()ed
                time.sleep(0.001)
        elif case == "seen":
            with pytest.raises(pycomm.CommError):
                comm.all_reduce(t)
        else:
            comm.abort("the user gives up")
        try:
            comm.close()
            out[case] = None
        except pycomm.CommError as e:
            out[case] = str(e)
        assert comm.closed
        comm.close()  # idempotent: says it once
    return out


@pytest.mark.parametrize("transport", ["shm", "gloo"])
def test_close_reports_a_failure_nobody_saw(transport):
    for out in spawn_ranks(_close_after_failures, 2, transport, timeout=300):
        assert out["unseen"] is not None and "no call has raised it yet" in out["unseen"]
        assert "count differs" in out["unseen"] or "mismatched" in out["unseen"] \
            or "aborted" in out["unseen"], out["unseen"]
        assert out["seen"] is None
        assert out["aborted"] is None
