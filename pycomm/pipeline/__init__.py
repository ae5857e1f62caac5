"""Pipeline parallelism over pycomm's point-to-point.

A model cut into stages (:func:`split_sequential`) runs one stage per rank (or
several, interleaved); microbatches flow forward as activations and backward
as gradients. The API follows ``torch.distributed.pipelining``::

    stage = PipelineStage(stages[comm.rank], comm.rank, comm.world_size, comm)
    schedule = Schedule1F1B(stage, n_microbatches=8, loss_fn=F.cross_entropy)
    if stage.is_first:
        schedule.step(x)
    elif stage.is_last:
        schedule.step(target=y, losses=losses)
    else:
        schedule.step()

Schedules are data (per-rank action lists, :mod:`pycomm.pipeline._actions`);
``python -m pycomm.pipeline.show 1f1b --stages 4 --microbatches 8`` draws one.
"""

from .mesh import pipeline_data_groups
from .schedules import (
    PipelineSchedule,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    split_microbatches,
)
from .split import balance_by_time, split_sequential
from .stage import PipelineStage

__all__ = [
    "PipelineSchedule",
    "PipelineStage",
    "Schedule1F1B",
    "ScheduleGPipe",
    "ScheduleInterleaved1F1B",
    "balance_by_time",
    "pipeline_data_groups",
    "split_microbatches",
    "split_sequential",
]
