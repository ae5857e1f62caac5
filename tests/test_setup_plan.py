"""The setup's pure steps (pycomm/_setup.py, pycomm/_store.py): the store
agreement every collective setup decision uses, and the transport decided
once into a Plan before one builder per transport builds it."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from pycomm import CommError, _store
from pycomm._setup import BUILDERS, Plan, Settings, plan_transport


def _on_ranks(n, fn):
    """fn(rank) on n threads sharing one HashStore; the results by rank."""
    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=30))
    out = [None] * n

    def run(r):
        out[r] = fn(store, r)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


def test_all_gather_and_agree_errors():
    values = _on_ranks(3, lambda st, r: _store.all_gather(st, "k", r, 3, f"v{r}", "test"))
    assert values == [["v0", "v1", "v2"]] * 3
    errors = _on_ranks(3, lambda st, r: _store.agree_errors(st, "e", r, 3, "bad" if r == 1 else "",
                                                            "test"))
    assert errors == [[(1, "bad")]] * 3


def test_broadcast_gives_every_rank_the_roots_value():
    values = _on_ranks(3, lambda st, r: _store.broadcast(st, "b", r, "x" if r == 1 else None,
                                                         "test", root=1))
    assert values == ["x"] * 3
    with pytest.raises(ValueError, match="the root"):
        _store.broadcast(dist.HashStore(), "b", 0, None, "test")


def test_wait_for_names_the_missing_ranks():
    store = dist.HashStore()
    store.set_timeout(timedelta(milliseconds=200))
    store.set("k/0", "x")
    with pytest.raises(CommError, match=r"setting up: rank 1 did not arrive"):
        _store.wait_for(store, {0: "k/0", 1: "k/1"}, "setting up")


def test_a_watched_wait_names_a_rank_that_exited_at_once():
    """Under watching_liveness (a group's rendezvous), a missing rank that
    the callback says exited is named within a slice, not at the timeout."""
    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=30))
    store.set("k/0", "x")
    start = time.monotonic()
    with _store.watching_liveness(lambda missing: [q for q in missing if q == 1]):
        with pytest.raises(CommError, match=r"setting up: rank 1 exited before arriving"):
            _store.wait_for(store, {0: "k/0", 1: "k/1"}, "setting up")
    assert time.monotonic() - start < 10


def test_a_watched_wait_keeps_the_store_timeout_and_its_message():
    store = dist.HashStore()
    store.set_timeout(timedelta(milliseconds=300))
    with _store.watching_liveness(lambda missing: []):
        with pytest.raises(CommError, match=r"rank 1 did not arrive"):
            _store.wait_for(store, {1: "k/1"}, "setting up")


def test_a_watched_wait_returns_once_every_rank_arrived():
    def gather(st, r):
        with _store.watching_liveness(lambda missing: []):  # per thread: a context of its own
            return _store.all_gather(st, "w", r, 3, f"v{r}", "test")

    assert _on_ranks(3, gather) == [["v0", "v1", "v2"]] * 3


def test_a_rank_without_a_process_key_is_not_called_exited():
    """A communicator made by an NCCL split published no process/<rank>:
    liveness must not block on the missing key (until the store's timeout)."""
    from pycomm import _shrink

    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=30))
    start = time.monotonic()
    assert _shrink.exited(store, [0, 1]) == []
    assert time.monotonic() - start < 5


def _asked(transport):
    return Settings(transport=transport, device=None, timeout=timedelta(seconds=30),
                    slice_bytes=None, check=False)


@pytest.mark.parametrize("transport", ["shm", "gloo", "nccl"])
def test_an_explicit_transport_is_the_plan(transport):
    assert plan_transport(dist.HashStore(), 0, 2, _asked(transport)) == Plan(transport)


@pytest.mark.parametrize("asked", ["auto", "shm+gloo"])
def test_auto_on_one_host_plans_shm_with_fallback(asked):
    plans = _on_ranks(2, lambda st, r: plan_transport(st, r, 2, _asked(asked)))
    # across_hosts known: a gloo fallback's builder need not ask the store again
    assert plans == [Plan("shm", fallback_ok=True, across_hosts=False)] * 2


def test_every_planned_transport_has_a_builder():
    assert set(BUILDERS) == {"shm", "gloo", "nccl", "shm+gloo"}
