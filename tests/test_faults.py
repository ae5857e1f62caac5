"""Fault injection: a rank is SIGKILLed before, during or after a large
all-reduce, a broadcast and a send/recv exchange. Every survivor must raise
pycomm.CommError (naming the op, its sequence number, a peer rank and the
transport) within the communicator timeout + 5 s, later calls must raise at
once, close() must return, no process may be left behind and nothing may be
left in /dev/shm.

Each trial runs in fresh processes: tests._dist.run_fault_trials spawns one
host per rank and forks a new trial rank per trial (see fork_trials). The
figures (trials, survivors raised, worst time to error) are printed; run with
``-s`` to see them. ``-m slow`` runs 10 trials per case instead of 2.
"""

from __future__ import annotations

import os
import random
import re
import signal
import time

import pytest
import torch

from tests._dist import run_fault_trials, spawn_ranks

WORLD = 3
COMM_TIMEOUT_S = 5.0
SLACK_S = 5.0
LARGE = 4 << 20  # elements (16 MiB of float32): many ring slices in flight
OPS = ["all_reduce", "broadcast", "sendrecv"]
WHENS = ["before", "during", "after"]
SHM_PREFIX = "pycomm-"  # /dev/shm/pycomm-<pid>-... (shm transport segments)


def _victim(case: int, trial: int) -> int:
    """Rotates over every rank, rank 0 (which creates the shm segment and
    whose pid names it) included."""
    return (case + trial) % WORLD


def _trial(rank, world, store, index, transport, cases, trials, timeout_s, count):
    import pycomm

    op, when = cases[index // trials]
    trial = index % trials
    victim = _victim(index // trials, trial)
    # Trials are not in lockstep across hosts (a survivor may still be waiting
    # out the last trial's timeout): meet first, under the store's own 60 s
    # timeout, so the short comm timeout bounds only the fault.
    store.set(f"arrived/{rank}", "1")
    store.wait([f"arrived/{r}" for r in range(world)])
    t0 = time.time()
    comm = pycomm.init(rank=rank, world_size=world, store=store, transport=transport,
                       timeout=timeout_s, set_default=False)
    init_s = time.time() - t0
    t = torch.full((count,), float(rank + 1))
    r2 = torch.empty_like(t)

    def call(async_op=False):
        if op == "all_reduce":
            return comm.all_reduce(t, async_op=async_op)
        if op == "broadcast":
            return comm.broadcast(t, src=0, async_op=async_op)
        works = comm.batch_isend_irecv([pycomm.P2POp("isend", t, (rank + 1) % world),
                                        pycomm.P2POp("irecv", r2, (rank - 1) % world)])
        if async_op:
            return works[0]
        works[0].wait()

    def die():
        store.set("killed_at", repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)

    comm.barrier()  # every rank is connected and past init
    if rank == victim:
        if when == "before":
            die()
        if when == "during":
            call(async_op=True)
            time.sleep(random.uniform(0.0, 0.03))
            die()
        call()  # after
        die()

    res = {"rank": rank, "init_s": init_s}
    start = time.time()
    try:
        if trial % 2:
            call(async_op=True).wait()  # Work.wait() of a failed async op raises too
        else:
            call()
        # "after": the victim finished this op too. "during": this rank's part
        # may legitimately complete when everything it needed from the victim
        # arrived before the kill (e.g. its recv of a send/recv exchange). The
        # next op needs the dead rank and must raise.
        res["first_completed"] = True
        start = time.time()
        call()
        res["raised"] = None
    except pycomm.CommError as e:
        res["raised"] = "CommError"
        res["msg"] = str(e)
    except Exception as e:  # the wrong kind of error
        res["raised"] = type(e).__name__
        res["msg"] = str(e)
    res["t_error"] = time.time()
    killed_at = float(store.get("killed_at").decode())
    res["time_to_error"] = res["t_error"] - max(killed_at, start)
    # Later calls raise at once instead of hanging.
    t1 = time.time()
    try:
        comm.all_reduce(torch.ones(4))
        res["later"] = None
    except pycomm.CommError as e:
        res["later"] = "CommError"
        res["later_msg"] = str(e)
    except Exception as e:
        res["later"] = type(e).__name__
    res["later_s"] = time.time() - t1
    t2 = time.time()
    comm.close()
    res["close_s"] = time.time() - t2
    return res


def _shm_entries():
    try:
        return {n for n in os.listdir("/dev/shm") if n.startswith(SHM_PREFIX)}
    except FileNotFoundError:
        return set()


_CASES = [(op, when) for op in OPS for when in WHENS]
_cache: dict = {}


def _records(transport, trials):
    """Every (op, when) case of one transport in one session of fresh hosts
    (spawning hosts costs seconds; each trial still forks fresh ranks)."""
    key = (transport, trials)
    if key not in _cache:
        shm_before = _shm_entries()
        records = run_fault_trials(_trial, WORLD, len(_CASES) * trials, transport, _CASES,
                                   trials, COMM_TIMEOUT_S, LARGE,
                                   trial_timeout=COMM_TIMEOUT_S + SLACK_S + 30)
        _cache[key] = (records, shm_before)
    return _cache[key]


def _run_case(transport, op, when, trials):
    all_records, shm_before = _records(transport, trials)
    i = _CASES.index((op, when))
    records = all_records[i * trials:(i + 1) * trials]
    problems, worst, survivors, raised, pids, sample = [], 0.0, 0, 0, [], ""
    completed = 0  # "during": survivors whose op finished before the kill mattered
    for trial, recs in enumerate(records):
        victim = _victim(i, trial)
        for r, rec in enumerate(recs):
            pids.append(rec["pid"])
            where = f"trial {trial}, rank {r}"
            if rec.get("hung"):
                problems.append(f"{where}: hung (killed after the trial timeout)")
                continue
            if r == victim:
                if rec.get("died") != -signal.SIGKILL:
                    problems.append(f"{where}: the victim did not die by SIGKILL: {rec}")
                continue
            if "result" not in rec:
                problems.append(f"{where}: survivor died: {rec}")
                continue
            res = rec["result"]
            survivors += 1
            if res["raised"] != "CommError":
                problems.append(f"{where}: expected CommError, got {res['raised']}: "
                                f"{res.get('msg', '')[:300]}")
                continue
            raised += 1
            completed += bool(res.get("first_completed")) and when == "during"
            sample = sample or res["msg"]
            worst = max(worst, res["time_to_error"])
            msg = res["msg"]
            want_op = "batch_isend_irecv" if op == "sendrecv" else op
            for frag in (want_op, "#", transport):
                if frag not in msg:
                    problems.append(f"{where}: message lacks {frag!r}: {msg[:300]}")
            # the peer: some rank other than this one ("recv from rank 2",
            # "peer rank 1 (pid ...) has died", "rank 0 aborted ...")
            if not set(re.findall(r"rank (\d+)", msg)) - {str(r)}:
                problems.append(f"{where}: message names no peer: {msg[:300]}")
            if res["time_to_error"] > COMM_TIMEOUT_S + SLACK_S:
                problems.append(f"{where}: raised after {res['time_to_error']:.1f} s")
            if res["later"] != "CommError" or res["later_s"] > 1.0:
                problems.append(f"{where}: a later call gave {res['later']} after "
                                f"{res['later_s']:.2f} s")
            if res["close_s"] > COMM_TIMEOUT_S + SLACK_S:
                problems.append(f"{where}: close() took {res['close_s']:.1f} s")
    left = [p for p in pids if os.path.exists(f"/proc/{p}")]
    if left:
        problems.append(f"processes left behind: {left}")
    leaked = sorted(n for n in _shm_entries() - shm_before
                    if any(f"-{p}-" in n for p in pids))
    if leaked:
        problems.append(f"left in /dev/shm: {leaked}")
    print(f"\n[faults] transport={transport} op={op} kill={when}: trials={trials} "
          f"survivors raised={raised}/{survivors} worst time-to-error={worst:.2f} s "
          f"(comm timeout {COMM_TIMEOUT_S:.0f} s)"
          + (f"; {completed} raised on the next op" if completed else "") + "\n"
          f"  e.g. {sample[:400]}")
    assert not problems, "\n".join(problems)
    assert survivors == trials * (WORLD - 1)


@pytest.mark.parametrize("when", WHENS)
@pytest.mark.parametrize("op", OPS)
def test_rank_killed(transport, op, when):
    _run_case(transport, op, when, trials=2)


@pytest.mark.slow
@pytest.mark.parametrize("when", WHENS)
@pytest.mark.parametrize("op", OPS)
def test_rank_killed_many(transport, op, when):
    _run_case(transport, op, when, trials=10)


# ------------------------------------------------- abort from another thread

def _abort_hung(rank, world, port, transport):
    import threading
    from datetime import timedelta

    import torch.distributed as dist

    import pycomm
    from tests._dist import client_store

    store = client_store(port, world)
    comms = [pycomm.init(rank=rank, world_size=world, store=dist.PrefixStore(f"abort{i}", store),
                         transport=transport, timeout=60, set_default=False) for i in range(2)]
    for c in comms:
        c.barrier()
    if rank == 1:  # never joins the collectives: rank 0 would wait out 60 s
        store.wait(["rank0_done"], timedelta(seconds=60))
        for c in comms:
            c.close()
        return None
    out = {}
    for mode, comm in zip(("sync", "async"), comms):
        # a watchdog thread aborts the communicator while the collective blocks
        timer = threading.Timer(0.5, comm.abort, (f"watchdog ({mode})",))
        timer.start()
        t0 = time.time()
        try:
            if mode == "sync":
                comm.all_reduce(torch.ones(1 << 20))
            else:
                comm.all_reduce(torch.ones(1 << 20), async_op=True).wait()
            out[mode] = None
        except pycomm.CommError as e:
            out[mode] = (time.time() - t0, str(e))
        timer.join()
        t1 = time.time()
        try:
            comm.barrier()
        except pycomm.CommError as e:
            out[mode + " later"] = (time.time() - t1, str(e))
        comm.close()
    store.set("rank0_done", "1")
    return out


def test_abort_from_another_thread_unblocks(transport):
    from tests._dist import spawn_ranks

    res = spawn_ranks(_abort_hung, 2, transport, timeout=90)[0]
    for mode in ("sync", "async"):
        assert res[mode] is not None, f"{mode}: no CommError"
        elapsed, msg = res[mode]
        print(f"\n[faults] {transport}: abort() from a watchdog thread unblocked a {mode} "
              f"all_reduce after {elapsed:.2f} s: {msg[:300]}")
        assert elapsed < 10, (mode, elapsed)
        assert "all_reduce #" in msg and transport in msg, msg
        later_s, later = res[mode + " later"]
        assert later_s < 1.0 and f"watchdog ({mode})" in later, later


# ------------------------------------------------- a live but stuck peer

STUCK_TIMEOUT_S = 1.0
_STUCK_OPS = {
    "all_reduce": lambda c, t: c.all_reduce(t),
    "broadcast (async)": lambda c, t: c.broadcast(t, src=0, async_op=True).wait(),
    "reduce_scatter": lambda c, t: c.reduce_scatter(torch.empty(t.numel() // 2), t),
    "all_gather": lambda c, t: c.all_gather(torch.empty(t.numel() * 2), t),
    "barrier": lambda c, t: c.barrier(),
    "irecv": lambda c, t: c.irecv(t, 1).wait(),
    "isend (large)": lambda c, t: c.isend(t, 1).wait(),
    "recv": lambda c, t: c.recv(t, 1),
}

_STUCK_OP_NAMES = {"irecv": "recv", "isend (large)": "send"}  # Work.op of user p2p


def _stuck_peer(rank, world, port, transport):
    from datetime import timedelta

    import torch.distributed as dist

    import pycomm
    from tests._dist import client_store

    store = client_store(port, world)
    comms = {name: pycomm.init(rank=rank, world_size=world,
                               store=dist.PrefixStore(f"stuck/{i}", store), transport=transport,
                               timeout=STUCK_TIMEOUT_S, set_default=False)
             for i, name in enumerate(_STUCK_OPS)}
    out = {}
    if rank == 1:  # alive, connected, but never calls anything
        store.wait(["rank0_done"], timedelta(seconds=120))
    else:
        for name, call in _STUCK_OPS.items():
            t0 = time.time()
            try:
                call(comms[name], torch.ones(4 << 20))
                out[name] = (None, time.time() - t0, "")
            except pycomm.CommError as e:
                out[name] = ("CommError", time.time() - t0, str(e))
            except Exception as e:
                out[name] = (type(e).__name__, time.time() - t0, str(e))
        store.set("rank0_done", "1")
    for c in comms.values():
        c.close()
    return out


def test_stuck_peer_every_wait_times_out(transport):
    """Every kind of blocking wait gives up after the communicator timeout
    when the peer is alive but never takes part (no dead socket to notice)."""
    from tests._dist import spawn_ranks

    res = spawn_ranks(_stuck_peer, 2, transport, timeout=120)[0]
    problems = []
    for name, (kind, elapsed, msg) in res.items():
        print(f"\n[faults] {transport}: stuck peer, {name}: {kind} after {elapsed:.2f} s "
              f"(timeout {STUCK_TIMEOUT_S:.0f} s): {msg[:200]}")
        if kind != "CommError":
            problems.append(f"{name}: {kind} {msg[:200]}")
        elif not (STUCK_TIMEOUT_S * 0.9 <= elapsed <= STUCK_TIMEOUT_S + SLACK_S):
            problems.append(f"{name}: raised after {elapsed:.2f} s")
        elif _STUCK_OP_NAMES.get(name, name.split()[0]) + " #" not in msg:
            problems.append(f"{name}: message lacks the op or its number: {msg[:200]}")
    assert not problems, "\n".join(problems)


# Rank 2 hangs (alive, never calls). Rank 0 blocks in a send to it; rank 1,
# which began waiting for it earlier, times out first. Rank 0 must learn
# rank 1's reason at once, not at its own timeout: on shm through the
# segment's shared abort word; on gloo through the store (gloo closes every
# connection of a rank whose wait timed out, "Application timeout caused
# pair closure", so rank 1 can send nothing more, and rank 0's pair to rank
# 2 stays open): rank 1 sets the reason, rank 0's watcher polls it.
_TOLD_TIMEOUT_S = 4.0


def _told_while_sending(rank, world, port, transport):
    from datetime import timedelta

    import pycomm
    from tests._dist import client_store

    store = client_store(port, world)
    comm = pycomm.init(rank=rank, world_size=world, store=store, transport=transport,
                       timeout=_TOLD_TIMEOUT_S, set_default=False)
    out = (None, 0.0, "")
    if rank != 2:  # rank 2 stays alive and never calls anything
        if rank == 0:  # starts later: its own timeout would come half a timeout after rank 1's
            time.sleep(_TOLD_TIMEOUT_S / 2)
        try:
            if rank == 0:
                comm.send(torch.ones(LARGE), dst=2)  # rank 2 never receives it
            else:
                comm.recv(torch.empty(16), src=2)  # rank 2 never sends
        except pycomm.CommError as e:
            out = ("CommError", time.time(), str(e))
        store.set(f"told_done/{rank}", "1")
    # Nobody closes (which a peer would see as a lost connection) before
    # both have raised.
    store.wait(["told_done/0", "told_done/1"], timedelta(seconds=120))
    comm.close()
    return out


@pytest.mark.parametrize("transport", ["shm", "gloo"])
def test_blocked_sender_learns_a_peers_failure_at_once(transport):
    from tests._dist import spawn_ranks

    res = spawn_ranks(_told_while_sending, 3, transport, timeout=120)
    (kind0, at0, msg0), (kind1, at1, msg1) = res[0], res[1]
    assert kind1 == "CommError" and "timed out" in msg1.lower(), msg1
    assert kind0 == "CommError", res[0]
    # rank 0's own timeout would end at about at1 + _TOLD_TIMEOUT_S / 2
    assert at0 - at1 < 1.0, f"rank 0 learned {at0 - at1:.2f} s after rank 1 failed: {msg0}"
    assert "rank 1 aborted the communicator" in msg0 and "timed out" in msg0.lower(), msg0
    print(f"\n[faults] {transport}: rank 0 told {at0 - at1:.3f} s after rank 1 failed: {msg0[:160]}")


# ---------------------------------------------------------------- init window

# (victim, point): the victim dies by SIGKILL, or is interrupted (Ctrl-C's
# KeyboardInterrupt), just before or just after it creates (rank 0) or maps
# (others) the shm segment, i.e. before every rank has mapped it.
_INIT_CASES = [(v, p) for v in (0, WORLD - 1) for p in ("kill_before_map", "kill_after_map",
                                                        "interrupt_after_map")]
_STORE_TIMEOUT_S = 3.0  # survivors give up waiting for the victim in the store


def _init_trial(rank, world, store, index, cases):
    from datetime import timedelta

    import pycomm
    from pycomm._ext import _C

    victim, point = cases[index]
    store.set(f"arrived/{rank}", "1")
    store.wait([f"arrived/{r}" for r in range(world)])
    store.set_timeout(timedelta(seconds=_STORE_TIMEOUT_S))
    if rank == victim:
        real = _C.make_shm_comm

        def make_and_fail(*args):
            if point == "kill_before_map":
                os.kill(os.getpid(), signal.SIGKILL)
            impl = real(*args)
            if point == "kill_after_map":
                os.kill(os.getpid(), signal.SIGKILL)
            raise KeyboardInterrupt  # as if Ctrl-C came right after the mapping

        _C.make_shm_comm = make_and_fail  # the module _setup calls it through
    try:
        comm = pycomm.init(rank=rank, world_size=world, store=store, transport="shm",
                           timeout=COMM_TIMEOUT_S, set_default=False)
    except BaseException as e:  # noqa: BLE001 - the store's timeout, or the interrupt
        return type(e).__name__
    comm.close()
    return "ok"


def test_rank_dies_during_shm_init_leaves_nothing():
    """A rank that dies or is interrupted inside init(transport="shm"),
    rank 0 included, leaves nothing in /dev/shm; the others raise."""
    shm_before = _shm_entries()
    records = run_fault_trials(_init_trial, WORLD, len(_INIT_CASES), _INIT_CASES,
                               trial_timeout=_STORE_TIMEOUT_S * 4 + 30)
    problems, pids = [], []
    for (victim, point), recs in zip(_INIT_CASES, records):
        for r, rec in enumerate(recs):
            pids.append(rec["pid"])
            where = f"victim {victim} {point}, rank {r}"
            if rec.get("hung"):
                problems.append(f"{where}: hung")
            elif r == victim and point.startswith("kill"):
                if rec.get("died") != -signal.SIGKILL:
                    problems.append(f"{where}: the victim did not die: {rec}")
            elif r == victim:
                if rec.get("result") != "KeyboardInterrupt":
                    problems.append(f"{where}: expected KeyboardInterrupt: {rec}")
            elif rec.get("result") in (None, "ok"):
                problems.append(f"{where}: a survivor did not raise: {rec}")
    leaked = sorted(n for n in _shm_entries() - shm_before
                    if any(f"-{p}-" in n for p in pids))
    assert not problems, "\n".join(problems)
    assert not leaked, f"left in /dev/shm: {leaked}"


# ---------------------------------------------------------------- the store lost

_AFTER_THE_STORE = r'''
import os, sys, time, torch, torch.distributed as dist, pycomm
d = sys.argv[1]
dist.init_process_group("gloo")
comm = pycomm.init(group=dist.group.WORLD, transport="shm", set_default=False, timeout=5)
open(os.path.join(d, f"ready{dist.get_rank()}"), "w").close()
while not os.path.exists(os.path.join(d, "killed")):
    time.sleep(0.02)
t = torch.ones(4)
comm.all_reduce(t)  # the transport does not need the store
try:
    comm.new_group([0, 1])
    print("no error")
except pycomm.CommError as e:
    print(f"{t.tolist()} CommError: {e}")
'''


def _member_exits_before_the_group(rank, world, port, transport):
    import pycomm
    from tests._dist import client_store

    store = client_store(port, world)  # its timeout: 60 s
    comm = pycomm.init(rank=rank, world_size=world, store=store, transport=transport, timeout=5,
                       set_default=False)
    comm.barrier()
    if rank == 2:
        os._exit(0)  # gone before the group's rendezvous
    t0 = time.monotonic()
    try:
        comm.new_group([2, 0, 1])  # rank 2 is the group's rank 0
        out = ("created", "", time.monotonic() - t0)
    except pycomm.CommError as e:
        out = ("raised", str(e), time.monotonic() - t0)
    comm.abort("test over")
    comm.close()
    return out


@pytest.mark.parametrize("transport", ["shm", "gloo"])
def test_a_member_that_exited_fails_the_group_at_once(transport):
    """A member that exited before a group's rendezvous is named, by its
    rank in the communicator that makes the group and its group rank, well
    before the store's 60 s and the communicator's 5 s: within about a
    second (the group's rendezvous watches its members' processes)."""
    results = spawn_ranks(_member_exits_before_the_group, 3, transport, timeout=150)
    assert results[2] == ("died", 0), results[2]
    for r in (0, 1):
        status, msg, elapsed = results[r]
        assert status == "raised" and "rank 2 (group rank 0) exited" in msg, results[r]
        assert "creating the group of ranks [2, 0, 1]" in msg, msg
        assert elapsed < 30, f"rank {r} took {elapsed:.1f} s"  # the store's timeout is 60 s


def _member_absent_from_the_group(rank, world, port, transport):
    import pycomm
    from tests._dist import client_store

    store = client_store(port, world)  # its timeout: 60 s
    comm = pycomm.init(rank=rank, world_size=world, store=store, transport=transport, timeout=30,
                       set_default=False)
    comm.barrier()
    t0 = time.monotonic()
    if rank == 2:  # alive, but busy elsewhere past the group's timeout, then late
        time.sleep(7)
        try:
            comm.new_group([2, 0, 1], timeout=2)
            out = ("late", "created", 0.0)
        except pycomm.CommError as e:
            out = ("late", str(e), 0.0)
    else:
        try:
            comm.new_group([2, 0, 1], timeout=2)  # rank 2 is the group's rank 0
            out = ("created", "", time.monotonic() - t0)
        except pycomm.CommError as e:
            out = ("raised", str(e), time.monotonic() - t0)
    comm.abort("test over")
    comm.close()
    return out


@pytest.mark.parametrize("transport", ["shm", "gloo"])
def test_a_member_that_never_arrives_fails_the_group_at_its_timeout(transport):
    """A member alive but absent from a group's rendezvous (stopped, busy, or
    on another host, where no process can be watched) is named at the
    group's timeout (2 s here), as torch's new_group does, not at the store's
    60 s; when it comes later, it is told that the others gave up."""
    results = spawn_ranks(_member_absent_from_the_group, 3, transport, timeout=150)
    assert results[2][0] == "late" and "the other members gave up first" in results[2][1], results[2]
    for r in (0, 1):
        status, msg, elapsed = results[r]
        assert status == "raised" and "creating the group of ranks [2, 0, 1]" in msg, results[r]
        assert "rank 2 (group rank 0) did not arrive within the group's timeout (2 s)" in msg, msg
        assert elapsed < 6.5, f"rank {r} took {elapsed:.1f} s"  # rank 2 comes at 7 s, the store 60


def test_new_group_after_the_store_died_names_the_store(tmp_path):
    """The store's server killed mid-job: collectives go on (the transport is
    set up), and creating a group raises CommError at once saying the store
    is unreachable (not a hang until the timeout)."""
    import subprocess

    from pycomm.bench.chaos import _store_server
    from pycomm.bench.launch import start_script

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    server, port = _store_server(2, 60)
    try:
        _, procs = start_script(["-c", _AFTER_THE_STORE, str(tmp_path)], 2, store_port=port,
                                env={"PYTHONPATH": root, "OMP_NUM_THREADS": "1"})
        deadline = time.monotonic() + 60
        while not all((tmp_path / f"ready{r}").exists() for r in range(2)):
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs)
            time.sleep(0.05)
    finally:
        server.kill()
        server.wait()
    (tmp_path / "killed").touch()
    for p in procs:
        try:
            out, err = p.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        assert "[2.0, 2.0, 2.0, 2.0] CommError: creating the group" in out, out + err[-2000:]
        assert "the store is unreachable" in out, out
