"""``python -m pycomm.bench`` (and the ``pycomm-bench`` console script).

    python -m pycomm.bench allreduce --nproc 2 -b 1K -e 64M -f 4 --json r.json --plot r.png
    torchrun --nproc-per-node 2 -m pycomm.bench allreduce -b 1K -e 64M -f 4
    python -m pycomm.bench model r.json
    python -m pycomm.bench soak --nproc 3 --duration 60
    python -m pycomm.bench chaos --nproc 3 --faults 20
    python -m pycomm.bench tune --nproc 4 --transport gloo --out auto_table.json
"""

from __future__ import annotations

import sys
from typing import Sequence

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit code (0 ok, 1 failure or wrong results,
    2 usage error, 124 timeout)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "model":
        from .model_cli import main as model_main

        return model_main(argv[1:])
    if argv and argv[0] == "tune":
        from .tune import main as tune_main

        return tune_main(argv[1:])
    if argv and argv[0] == "soak":
        from .soak import main as soak_main

        return soak_main(argv[1:])
    if argv and argv[0] == "chaos":
        from .chaos import main as chaos_main

        return chaos_main(argv[1:])
    from .cli import parse_args
    from .launch import launch

    return launch(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
