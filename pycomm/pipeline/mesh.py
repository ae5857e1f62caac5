"""Pipeline x data parallel: the two sub-communicators of a rank grid."""

from __future__ import annotations

from ..comm import Communicator

__all__ = ["pipeline_data_groups"]


def pipeline_data_groups(comm: Communicator,
                         pipeline_size: int) -> tuple[Communicator, Communicator]:
    """Splits ``comm`` into pipelines of ``pipeline_size`` consecutive ranks
    and data-parallel groups across them.

    Rank ``g`` of ``comm`` is rank ``g % pipeline_size`` of pipeline
    ``g // pipeline_size`` (a replica), and rank ``g // pipeline_size`` of
    the data-parallel group of the ranks holding the same stages::

        4 ranks, pipeline_size 2:   replica 0: ranks 0 -> 1   (pipe_comm)
                                    replica 1: ranks 2 -> 3
                                    dp groups: {0, 2}, {1, 3} (dp_comm)

    A collective of ``comm``: every rank calls it, in the same order.

    Args:
        comm: the communicator over all ranks.
        pipeline_size: ranks per pipeline; divides ``comm.world_size``.

    Returns:
        ``(pipe_comm, dp_comm)``: pass ``pipe_comm`` to the
        :class:`PipelineStage` and ``dp_comm`` to the schedule.

    Raises:
        ValueError: pipeline_size does not divide the world size.

    Example::

        >>> pipe, dp = pipeline_data_groups(comm, 2)
        >>> stage = PipelineStage(parts[pipe.rank], pipe.rank, 2, pipe)
        >>> schedule = Schedule1F1B(stage, 8, loss_fn, dp_comm=dp)
    """
    n = comm.world_size
    if not isinstance(pipeline_size, int) or isinstance(pipeline_size, bool) \
            or pipeline_size < 1 or n % pipeline_size:
        raise ValueError(f"pipeline_size must be an int >= 1 dividing the world size ({n}), "
                         f"got {pipeline_size!r}")
    replica, position = divmod(comm.rank, pipeline_size)
    pipe = comm.split(replica, key=position)
    dp = comm.split(position, key=replica)
    assert pipe is not None and dp is not None
    return pipe, dp
