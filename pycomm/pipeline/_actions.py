"""Schedules as data: per-rank action lists, built without tensors.

A schedule is fixed by a *policy*: for each rank and clock tick, which
computation (forward ``F`` or backward ``B`` of one microbatch on one stage) it
runs next among those whose inputs exist. :func:`timetable` plays the policy on
a unit clock (every computation takes one tick, as in torchgpipe's
``clock_cycles``) and :func:`rank_actions` turns the timetable into the ordered
list that one rank executes::

    tick      0    1    2    3    4    5    6    7
    rank 0    F0   F1   .    .    B0   B1   .    .      GPipe, 2 stages,
    rank 1    .    F0   F1   B0   B1   .    .    .      2 microbatches
              |         ^
              '-- phase 0: SEND_F(stage 0, mb 0) on rank 0 and
                  RECV_F(stage 1, mb 0) on rank 1

Communication happens in *phases*: phase ``t`` follows the computation of tick
``t`` on every rank. A tensor produced at tick ``t`` is sent in phase ``t`` and
received in phase ``t`` as well: both ends carry the transfer in the *same*
phase, in the same order (see ``_comm_key``). This is what makes the runtime
deadlock-free (argued in ``schedules.py``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = [
    "Action",
    "Kind",
    "bubble_fraction",
    "format_grid",
    "gpipe",
    "interleaved_1f1b",
    "one_f_one_b",
    "rank_actions",
    "theoretical_bubble",
    "timetable",
]


class Kind(str, enum.Enum):
    """What an action does."""

    FORWARD = "F"
    BACKWARD = "B"
    SEND_F = "SEND_F"  # send the activation that `stage` produced for `microbatch`
    RECV_F = "RECV_F"  # receive the input of `stage` for `microbatch`
    SEND_B = "SEND_B"  # send the input gradient that `stage` produced
    RECV_B = "RECV_B"  # receive the output gradient of `stage`

    def __repr__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Action:
    """One step of a rank's program.

    Attributes:
        kind: the :class:`Kind`.
        stage: the stage on *this* rank that computes, or whose tensor is sent
            or received.
        microbatch: the microbatch index.
        tick: the clock tick (computations) or phase (communication).
        peer: the other rank of a send or receive (-1 for computations).
    """

    kind: Kind
    stage: int
    microbatch: int
    tick: int
    peer: int = -1

    @property
    def is_compute(self) -> bool:
        return self.kind in (Kind.FORWARD, Kind.BACKWARD)

    def __str__(self) -> str:
        if self.is_compute:
            return f"{self.kind.value}{self.microbatch}s{self.stage}@{self.tick}"
        return f"{self.kind.value}(s{self.stage},mb{self.microbatch},peer{self.peer})@{self.tick}"


# (kind, stage, microbatch) of one computation.
Compute = tuple[Kind, int, int]


def _stage_rank(stage: int, world_size: int) -> int:
    return stage % world_size


@dataclass
class _State:
    num_stages: int
    tick: int
    done: dict[Compute, int]  # computation -> tick it ran

    def ready(self, c: Compute) -> bool:
        """Inputs of c were produced at an earlier tick, and c has not run."""
        kind, s, i = c
        if c in self.done:
            return False
        if kind is Kind.FORWARD:
            deps = [] if s == 0 else [(Kind.FORWARD, s - 1, i)]
        else:
            deps = [(Kind.FORWARD, s, i)]
            if s < self.num_stages - 1:
                deps.append((Kind.BACKWARD, s + 1, i))
        return all(d in self.done and self.done[d] < self.tick for d in deps)


def timetable(num_stages: int, orders: list[list[Compute]]) -> dict[Compute, int]:
    """Runs each rank's computations in the given order on a unit clock: a
    computation starts at the first tick after its inputs were produced and
    after the rank's previous computation. Returns the tick of each.

    If no rank can run its next computation (an order that waits on itself),
    each rank runs the first ready computation of its order instead, for one
    tick; the built-in orders never need this.
    """
    st = _State(num_stages, 0, {})
    pos = [0] * len(orders)
    total = sum(len(o) for o in orders)
    while len(st.done) < total:
        picks: list[Compute | None] = [
            o[pos[r]] if pos[r] < len(o) and st.ready(o[pos[r]]) else None
            for r, o in enumerate(orders)]
        if all(c is None for c in picks):
            picks = [next((c for c in o if st.ready(c)), None) for o in orders]
            if all(c is None for c in picks):
                st.tick += 1  # only possible while inputs of this tick land
                if st.tick > 4 * total + 8:
                    raise RuntimeError("the schedule's orders make no progress")
                continue
        for r, c in enumerate(picks):
            if c is not None:
                st.done[c] = st.tick
                while pos[r] < len(orders[r]) and orders[r][pos[r]] in st.done:
                    pos[r] += 1
        st.tick += 1
    return st.done


# ------------------------------------------------------------------ orders

def _rank_stages(rank: int, num_stages: int, world_size: int) -> list[int]:
    # Rank r holds stages r, r + world_size, r + 2 * world_size, ... (as torch).
    return list(range(rank, num_stages, world_size))


def _grouped(kind: Kind, stages: list[int], n: int, group: int, reverse: bool) -> list[Compute]:
    """Microbatches pass a rank's stages in groups of `group` (Megatron's
    interleaved order): group 0 through the first stage, group 0 through the
    second, ..., then group 1. Backwards visit the stages last to first. With
    one stage per rank this is microbatch order."""
    idx = {s: (len(stages) - 1 - k if reverse else k) for k, s in enumerate(stages)}
    return sorted(((kind, s, i) for s in stages for i in range(n)),
                  key=lambda c: (c[2] // group, idx[c[1]], c[2] % group))


def _one_f_one_b_order(fwd: list[Compute], bwd: list[Compute], warmup: int) -> list[Compute]:
    """Three phases: `warmup` forwards; then one forward, one backward while
    forwards remain; then the remaining backwards (cool-down)."""
    warmup = min(warmup, len(fwd))
    order = fwd[:warmup]
    f, b = fwd[warmup:], list(bwd)
    for fc in f:
        order += [fc, b.pop(0)]
    return order + b


# ------------------------------------------------------------------ schedules

def _check(num_stages: int, world_size: int, n_microbatches: int) -> None:
    for name, v in (("num_stages", num_stages), ("world_size", world_size),
                    ("n_microbatches", n_microbatches)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    if num_stages % world_size:
        raise ValueError(f"num_stages ({num_stages}) must be a multiple of world_size "
                         f"({world_size}): rank r holds stages r, r + world_size, ...")


def _build(num_stages: int, world_size: int, orders: list[list[Compute]]) -> list[list[Action]]:
    times = timetable(num_stages, orders)
    return [rank_actions(times, num_stages, world_size, r) for r in range(world_size)]


def gpipe(num_stages: int, n_microbatches: int) -> list[list[Action]]:
    """GPipe: every stage runs all forwards, then all backwards, in
    microbatch order (one stage per rank). Returns each rank's actions."""
    _check(num_stages, num_stages, n_microbatches)
    m = n_microbatches
    orders = [[(Kind.FORWARD, s, i) for i in range(m)] + [(Kind.BACKWARD, s, i) for i in range(m)]
              for s in range(num_stages)]
    return _build(num_stages, num_stages, orders)


def one_f_one_b(num_stages: int, n_microbatches: int, slack: int = 0) -> list[list[Action]]:
    """1F1B (PipeDream-flush): stage s runs ``num_stages - s - 1`` warm-up
    forwards, then alternates forward and backward, so it keeps at most
    ``num_stages - s`` microbatches of activations. Any n_microbatches >= 1.

    With ``slack`` k, every stage but the last runs k more warm-up forwards
    (and keeps k more microbatches): the grid and its bubble are unchanged,
    but each activation is sent k ticks before its consumer needs it. In
    plain 1F1B none is early: a rank's next forward waits on a round trip
    through its neighbour's backward, so every transfer and every
    computation running longer than its neighbour's costs idle time, which
    slack absorbs (benchmarks/pipeline/README.md)."""
    _check(num_stages, num_stages, n_microbatches)
    if not isinstance(slack, int) or isinstance(slack, bool) or slack < 0:
        raise ValueError(f"slack must be an int >= 0, got {slack!r}")
    m = n_microbatches
    orders = [_one_f_one_b_order([(Kind.FORWARD, s, i) for i in range(m)],
                                 [(Kind.BACKWARD, s, i) for i in range(m)],
                                 num_stages - s - 1 + (slack if s < num_stages - 1 else 0))
              for s in range(num_stages)]
    return _build(num_stages, num_stages, orders)


def interleaved_1f1b(num_stages: int, world_size: int, n_microbatches: int) -> list[list[Action]]:
    """Interleaved 1F1B (Megatron): rank r holds the v = num_stages /
    world_size stages r, r + world_size, ...; microbatches pass them in groups
    of world_size; rank r runs ``2 (world_size - r - 1) + (v - 1) world_size``
    warm-up forwards, then alternates. Any n_microbatches >= 1."""
    _check(num_stages, world_size, n_microbatches)
    w, m = world_size, n_microbatches
    v = num_stages // w
    orders = []
    for r in range(w):
        stages = _rank_stages(r, num_stages, w)
        orders.append(_one_f_one_b_order(_grouped(Kind.FORWARD, stages, m, w, False),
                                         _grouped(Kind.BACKWARD, stages, m, w, True),
                                         2 * (w - r - 1) + (v - 1) * w))
    return _build(num_stages, w, orders)


# ------------------------------------------------------------------ timetable -> actions

def _comm_key(a: Action) -> tuple[int, int, int]:
    """Order of the transfers of one phase, equal at both ends of a pair:
    gradients before activations, then by producing stage, then microbatch."""
    producer = {Kind.SEND_F: a.stage, Kind.RECV_F: a.stage - 1,
                Kind.SEND_B: a.stage, Kind.RECV_B: a.stage + 1}[a.kind]
    is_act = a.kind in (Kind.SEND_F, Kind.RECV_F)
    return (int(is_act), producer, a.microbatch)


def rank_actions(times: dict[Compute, int], num_stages: int, world_size: int,
                 rank: int) -> list[Action]:
    """The ordered program of `rank`: per tick its computation, then the
    transfers of that phase (tensors produced at that tick by it or for it)."""
    out: list[Action] = []
    by_tick: dict[int, list[Action]] = {}
    comm: dict[int, list[Action]] = {}
    for (kind, s, i), t in times.items():
        r = _stage_rank(s, world_size)
        if r == rank:
            by_tick.setdefault(t, []).append(Action(kind, s, i, t))
        # the consumer of what (kind, s, i) produced
        nxt = s + 1 if kind is Kind.FORWARD else s - 1
        if not 0 <= nxt < num_stages:
            continue
        rn = _stage_rank(nxt, world_size)
        if rn == r:
            continue  # same rank: handed over in memory
        if kind is Kind.FORWARD:
            send, recv = Kind.SEND_F, Kind.RECV_F
        else:
            send, recv = Kind.SEND_B, Kind.RECV_B
        if r == rank:
            comm.setdefault(t, []).append(Action(send, s, i, t, rn))
        if rn == rank:
            comm.setdefault(t, []).append(Action(recv, nxt, i, t, r))
    for t in sorted(set(by_tick) | set(comm)):
        out.extend(by_tick.get(t, []))
        out.extend(sorted(comm.get(t, []), key=_comm_key))
    return out


# ------------------------------------------------------------------ display

def format_grid(actions: list[list[Action]], label_stage: bool = False) -> str:
    """The time x rank grid of the computations: one row per rank, one
    column per tick, ``F3`` = forward of microbatch 3, ``.`` = idle. With
    `label_stage` the cell also names the stage (``F3s1``)."""
    ticks = 1 + max((a.tick for acts in actions for a in acts if a.is_compute), default=-1)
    cells = []
    for acts in actions:
        row = ["."] * ticks
        for a in acts:
            if a.is_compute:
                suffix = f"s{a.stage}" if label_stage else ""
                row[a.tick] = f"{a.kind.value}{a.microbatch}{suffix}"
        cells.append(row)
    width = max([len(c) for row in cells for c in row] + [2])
    lines = []
    for r, row in enumerate(cells):
        lines.append(f"rank {r}: " + " ".join(c.ljust(width) for c in row).rstrip())
    return "\n".join(lines)


def bubble_fraction(actions: list[list[Action]]) -> float:
    """Idle share of the grid: 1 - busy cells / (ranks x ticks)."""
    ticks = 1 + max(a.tick for acts in actions for a in acts if a.is_compute)
    busy = sum(a.is_compute for acts in actions for a in acts)
    return 1.0 - busy / (ticks * len(actions))


def theoretical_bubble(world_size: int, n_microbatches: int, stages_per_rank: int = 1) -> float:
    """(p - 1) / (v m + p - 1) for p ranks, m microbatches and v stages per
    rank (GPipe and 1F1B: v = 1)."""
    p, m, v = world_size, n_microbatches, stages_per_rank
    return (p - 1) / (v * m + p - 1)
