"""Schedules as data, without ranks or tensors: literal grids laid out like
the pipeline (one row per rank, one column per clock tick), the exact action
lists of a small case, and properties over many shapes (bubble = theory,
activation caps, every transfer paired in one phase)."""

from __future__ import annotations

import pytest

from pycomm.pipeline import _actions as A
from pycomm.pipeline._actions import Action, Kind
from pycomm.pipeline.show import main, render


def grid(text: str) -> str:
    """A literal grid as format_grid prints it (indentation stripped)."""
    return "\n".join(line.strip() for line in text.strip().splitlines())


def test_gpipe_grid():
    assert A.format_grid(A.gpipe(3, 4)) == grid("""
        rank 0: F0 F1 F2 F3 .  .  .  .  B0 B1 B2 B3
        rank 1: .  F0 F1 F2 F3 .  .  B0 B1 B2 B3 .
        rank 2: .  .  F0 F1 F2 F3 B0 B1 B2 B3 .  .
    """)


def test_1f1b_grid():
    assert A.format_grid(A.one_f_one_b(4, 8)) == grid("""
        rank 0: F0 F1 F2 F3 .  .  .  B0 F4 B1 F5 B2 F6 B3 F7 B4 .  B5 .  B6 .  B7
        rank 1: .  F0 F1 F2 .  .  B0 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5 .  B6 .  B7 .
        rank 2: .  .  F0 F1 .  B0 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 F7 B6 .  B7 .  .
        rank 3: .  .  .  F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7 .  .  .
    """)


def test_1f1b_slack_grid():
    # One more warm-up forward on every stage but the last: the same bubble,
    # each activation sent a tick before its consumer needs it.
    assert A.format_grid(A.one_f_one_b(2, 6, slack=1)) == grid("""
        rank 0: F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 .  B4 .  B5
        rank 1: .  F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 .
    """)
    for p, m in SHAPES:
        assert A.bubble_fraction(A.one_f_one_b(p, m, slack=1)) == \
            A.bubble_fraction(A.one_f_one_b(p, m))
        assert _live_peaks(A.one_f_one_b(p, m, slack=1)) == \
            [min(m, p - s + (s < p - 1)) for s in range(p)]
        _check_program(A.one_f_one_b(p, m, slack=1), p, p, m)
    with pytest.raises(ValueError, match="slack"):
        A.one_f_one_b(2, 4, slack=-1)


def test_1f1b_fewer_microbatches_than_stages():
    assert A.format_grid(A.one_f_one_b(3, 2)) == grid("""
        rank 0: F0 F1 .  .  .  B0 .  B1
        rank 1: .  F0 F1 .  B0 .  B1 .
        rank 2: .  .  F0 B0 F1 B1 .  .
    """)


def test_interleaved_grid():
    # rank 0 holds stages 0 and 2, rank 1 stages 1 and 3; microbatches pass
    # a rank's stages in groups of 2 (the world size).
    assert A.format_grid(A.interleaved_1f1b(4, 2, 4), label_stage=True) == grid("""
        rank 0: F0s0 F1s0 F0s2 F1s2 F2s0 B0s2 F3s0 B1s2 F2s2 B0s0 F3s2 B1s0 .    B2s2 .    B3s2 B2s0 B3s0
        rank 1: .    F0s1 F1s1 F0s3 B0s3 F1s3 B1s3 F2s1 B0s1 F3s1 B1s1 F2s3 B2s3 F3s3 B3s3 B2s1 B3s1 .
    """)


def test_gpipe_action_lists():
    F, B = Kind.FORWARD, Kind.BACKWARD
    rank0, rank1 = A.gpipe(2, 2)
    assert rank0 == [
        Action(F, 0, 0, 0), Action(Kind.SEND_F, 0, 0, 0, 1),
        Action(F, 0, 1, 1), Action(Kind.SEND_F, 0, 1, 1, 1),
        Action(Kind.RECV_B, 0, 0, 3, 1),
        Action(B, 0, 0, 4), Action(Kind.RECV_B, 0, 1, 4, 1),
        Action(B, 0, 1, 5),
    ]
    assert rank1 == [
        Action(Kind.RECV_F, 1, 0, 0, 0),
        Action(F, 1, 0, 1), Action(Kind.RECV_F, 1, 1, 1, 0),
        Action(F, 1, 1, 2),
        Action(B, 1, 0, 3), Action(Kind.SEND_B, 1, 0, 3, 0),
        Action(B, 1, 1, 4), Action(Kind.SEND_B, 1, 1, 4, 0),
    ]


SHAPES = [(p, m) for p in (1, 2, 3, 4, 5) for m in (1, 2, 3, 4, 5, 8, 13)]


@pytest.mark.parametrize("p,m", SHAPES)
def test_gpipe_and_1f1b_bubble_is_theory(p, m):
    for acts in (A.gpipe(p, m), A.one_f_one_b(p, m)):
        assert A.bubble_fraction(acts) == pytest.approx(A.theoretical_bubble(p, m))


@pytest.mark.parametrize("w,v,m", [(2, 2, 4), (2, 2, 8), (4, 2, 8), (4, 2, 16), (2, 3, 6)])
def test_interleaved_bubble_is_theory_when_m_divides(w, v, m):
    acts = A.interleaved_1f1b(w * v, w, m)
    assert A.bubble_fraction(acts) == pytest.approx(A.theoretical_bubble(w, m, v))


def _live_peaks(acts: list[list[Action]]) -> list[int]:
    peaks = []
    for rank in acts:
        live = peak = 0
        for a in rank:
            live += {Kind.FORWARD: 1, Kind.BACKWARD: -1}.get(a.kind, 0)
            peak = max(peak, live)
        peaks.append(peak)
    return peaks


@pytest.mark.parametrize("p,m", SHAPES)
def test_activation_caps(p, m):
    assert _live_peaks(A.one_f_one_b(p, m)) == [min(m, p - s) for s in range(p)]
    assert _live_peaks(A.gpipe(p, m)) == [m] * p


def _check_program(acts: list[list[Action]], num_stages: int, world: int, m: int):
    """Every computation once; each transfer is a send and a receive in the
    same phase, and the k-th message from a to b in (phase, key) order is the
    same transfer at both ends; a computation's inputs arrived in an earlier
    phase; every rank's ticks never go back."""
    computes = [(a.kind, a.stage, a.microbatch) for r in acts for a in r if a.is_compute]
    assert sorted(computes) == sorted((k, s, i) for k in (Kind.FORWARD, Kind.BACKWARD)
                                      for s in range(num_stages) for i in range(m))
    sent, received = {}, {}
    for r, rank in enumerate(acts):
        ticks = [a.tick for a in rank]
        assert ticks == sorted(ticks)
        for a in rank:
            assert a.stage % world == r
            if a.kind in (Kind.SEND_F, Kind.SEND_B):
                dst = a.stage + (1 if a.kind is Kind.SEND_F else -1)
                sent.setdefault((r, a.peer), []).append((a.tick, a.kind.value[-1], a.stage, dst,
                                                         a.microbatch))
            elif a.kind in (Kind.RECV_F, Kind.RECV_B):
                src = a.stage - (1 if a.kind is Kind.RECV_F else -1)
                received.setdefault((a.peer, r), []).append((a.tick, a.kind.value[-1], src,
                                                             a.stage, a.microbatch))
    assert sent == received
    arrived = {(a.stage, a.microbatch, a.kind): a.tick for r in acts for a in r
               if a.kind in (Kind.RECV_F, Kind.RECV_B)}
    for rank in acts:
        for a in rank:
            need = (Kind.RECV_F if a.kind is Kind.FORWARD else Kind.RECV_B)
            if a.is_compute and (a.stage, a.microbatch, need) in arrived:
                assert arrived[(a.stage, a.microbatch, need)] < a.tick


@pytest.mark.parametrize("p,m", SHAPES)
def test_transfers_pair_up(p, m):
    _check_program(A.gpipe(p, m), p, p, m)
    _check_program(A.one_f_one_b(p, m), p, p, m)


@pytest.mark.parametrize("w,v", [(1, 3), (2, 2), (2, 3), (3, 2), (4, 2)])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8])
def test_interleaved_any_microbatch_count(w, v, m):
    _check_program(A.interleaved_1f1b(w * v, w, m), w * v, w, m)


@pytest.mark.parametrize("args,match", [
    ((0, 4), "num_stages"), ((2, 0), "n_microbatches"), ((2, 1.5), "n_microbatches"),
])
def test_bad_arguments(args, match):
    with pytest.raises(ValueError, match=match):
        A.one_f_one_b(*args)
    with pytest.raises(ValueError, match="multiple of world_size"):
        A.interleaved_1f1b(5, 2, 4)


def test_show_prints_grid_and_bubble(capsys):
    main(["1f1b", "--stages", "4", "--microbatches", "8"])
    out = capsys.readouterr().out
    assert A.format_grid(A.one_f_one_b(4, 8)) in out
    assert "bubble fraction: 0.273 (theory (p-1)/(v*m+p-1) = 0.273" in out
    assert "SEND_F(s0,mb0,peer1)@0" in render("gpipe", 2, 2, actions=True)
    with pytest.raises(ValueError, match="--ranks"):
        render("gpipe", 2, 2, ranks=1)
