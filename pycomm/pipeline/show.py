"""Draws a schedule's time x rank grid with its bubble fraction.

Usage::

    python -m pycomm.pipeline.show 1f1b --stages 4 --microbatches 8
    python -m pycomm.pipeline.show interleaved --stages 8 --ranks 4 --microbatches 8
    python -m pycomm.pipeline.show gpipe --stages 2 --microbatches 2 --actions
"""

from __future__ import annotations

import argparse
import sys

from . import _actions

__all__ = ["main", "render"]

SCHEDULES = ("gpipe", "1f1b", "interleaved")


def render(schedule: str, stages: int, microbatches: int, ranks: int | None = None,
           actions: bool = False) -> str:
    """The text ``show`` prints: header, grid, bubble (measured and theory)
    and, with `actions`, every rank's action list."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    if schedule == "interleaved":
        ranks = ranks or max(1, stages // 2)
        acts = _actions.interleaved_1f1b(stages, ranks, microbatches)
    else:
        if ranks not in (None, stages):
            raise ValueError(f"{schedule} runs one stage per rank: --ranks must equal --stages")
        ranks = stages
        acts = (_actions.gpipe if schedule == "gpipe" else _actions.one_f_one_b)(stages,
                                                                                  microbatches)
    v = stages // ranks
    lines = [f"{schedule}: {stages} stages on {ranks} ranks, {microbatches} microbatches "
             "(F3 = forward of microbatch 3, B = backward, . = idle; one column per tick)",
             _actions.format_grid(acts, label_stage=v > 1),
             f"bubble fraction: {_actions.bubble_fraction(acts):.3f} "
             f"(theory (p-1)/(v*m+p-1) = {_actions.theoretical_bubble(ranks, microbatches, v):.3f}"
             f" with p={ranks}, v={v}, m={microbatches})"]
    if actions:
        for r, acts_r in enumerate(acts):
            lines.append(f"rank {r} actions:")
            lines += [f"  {a}" for a in acts_r]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pycomm.pipeline.show", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("schedule", choices=SCHEDULES)
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--ranks", type=int, default=None,
                    help="interleaved only: ranks (default stages / 2)")
    ap.add_argument("--actions", action="store_true", help="also print every rank's action list")
    args = ap.parse_args(argv)
    try:
        print(render(args.schedule, args.stages, args.microbatches, args.ranks, args.actions))
    except ValueError as e:
        ap.error(str(e))
    return 0


if __name__ == "__main__":
    sys.exit(main())
