"""Which GPU cases run where: ``PLANS[plan][world_size] -> [Case, ...]``.

``quick`` is what ``scripts/gpu_check.sh --quick`` runs at 2 and 3 ranks
sharing one GPU (within its 8 minutes, after the build and the kernel
tests); ``rest`` is what ``--rest`` adds: 4 ranks, the CUDA backend sweeps
and the remaining variants. Between them they run every body of
tests/test_gpu.py's multi-rank tests at each world size that test runs it at
(tests/test_gpu_check.py checks the (body, world size) pairs), and some at
more sizes (world 4 runs the whole collective sweep). Not every body runs at
4 ranks: the wire-dtype all-reduce, for one, runs at 2 and 3 (as in
tests/test_gpu.py), which is enough for its odd and even ring orders.

Order within a world: cheap cases first (a fault early costs a respawn, not
the world's time), the timeout/abort case last (it aborts a communicator on
purpose). Deadlines are generous upper bounds, several times what a case
needs on an H100 shared by 2-4 ranks (NCCL over loopback sockets: each op
takes milliseconds); a case past its deadline is recorded as hung.
"""

from __future__ import annotations

from tests import gpu_cases as c
from tests import gpu_cases_layers as layers
from tests.gpu_world import Case


def _collectives(world: int) -> list[Case]:
    """The collective sweep every world size runs."""
    return [
        Case("all_reduce_every_op_dtype", c.all_reduce_sweep, {"seed": world},
             init={"slice_bytes": 64 * 1024}, deadline_s=150),
        Case("broadcast_every_src", c.broadcast_every_src, init={"slice_bytes": 4096}, deadline_s=120),
        Case("reduce_scatter_all_gather", c.reduce_scatter_all_gather,
             init={"slice_bytes": 8192}, deadline_s=120),
        Case("reduce_gather_scatter_all_to_all", c.rooted_and_all_to_all, deadline_s=120),
        Case("p2p_and_batch", c.p2p_and_batch),
    ]


TIMEOUT_CASE = Case("timeout_aborts_and_raises", c.timeout_aborts, init={"timeout": 10},
                    close_may_fail=True, deadline_s=60)

QUICK: dict[int, list[Case]] = {
    2: [
        Case("argument_errors", c.argument_errors),
        Case("checked_mode", c.checked_mode, init={"check": True}),
        *_collectives(2),
        Case("all_reduce_default_slices_and_auto", c.default_slices_and_auto),
        # the quantized wires' bitwise check against the CPU over NCCL: at 2
        # ranks here (3 in --rest), so that a session whose time ends after
        # --quick still runs it
        Case("wire_dtype_bitwise_equals_cpu", c.wire_matches_cpu, init={"slice_bytes": 64 * 1024}),
        Case("user_p2p_beside_collectives", c.user_p2p_beside_collective),
        Case("async_work_future_and_stream_semantics", c.async_and_streams),
        Case("ddp_hooks_and_powerSGD", layers.ddp_hooks, deadline_s=120),
        Case("parallel_ddp", layers.parallel_ddp),
        Case("pipeline_1f1b_and_gpipe", layers.pipeline_two_stages),
        Case("backend_gloo_cuda_pycomm_ddp", layers.backend_ddp,
             {"backend": "cpu:gloo,cuda:pycomm"}),
        TIMEOUT_CASE,
    ],
    3: [
        *_collectives(3),
        Case("classic_algorithms", c.classic_algorithms, init={"slice_bytes": 64 * 1024}),
        Case("groups_split_and_new_group", c.groups),
        Case("parallel_ddp", layers.parallel_ddp),
        Case("backend_gloo_cuda_pycomm_ddp", layers.backend_ddp,
             {"backend": "cpu:gloo,cuda:pycomm"}),
    ],
}

REST: dict[int, list[Case]] = {
    4: [
        *_collectives(4),
        Case("classic_algorithms", c.classic_algorithms, init={"slice_bytes": 64 * 1024}),
        Case("groups_split_and_new_group", c.groups),
    ],
    2: [
        Case("backend_every_op_pycomm", layers.backend_every_op, {"backend": "pycomm"}, deadline_s=150),
        Case("backend_every_op_cpu_cuda_pycomm", layers.backend_every_op,
             {"backend": "cpu:pycomm,cuda:pycomm"}, deadline_s=150),
        Case("backend_stream_semantics", layers.backend_streams),
        Case("backend_pycomm_ddp", layers.backend_ddp, {"backend": "pycomm"}),
        Case("off_the_current_device", c.off_the_current_device, init={"device": "cuda:1"},
             min_gpus=2),
    ],
    3: [
        Case("ring_max_min_propagate_nan", c.nan_propagation, init={"slice_bytes": 256}),
        Case("wire_dtype_bitwise_equals_cpu", c.wire_matches_cpu, init={"slice_bytes": 64 * 1024}),
        Case("user_p2p_beside_collectives", c.user_p2p_beside_collective),
        Case("backend_every_op_pycomm", layers.backend_every_op, {"backend": "pycomm"}, deadline_s=150),
        Case("backend_pycomm_ddp", layers.backend_ddp, {"backend": "pycomm"}),
        Case("ddp_hooks_and_powerSGD", layers.ddp_hooks, deadline_s=120),
        TIMEOUT_CASE,
    ],
}

PLANS: dict[str, dict[int, list[Case]]] = {"quick": QUICK, "rest": REST}

# Bodies that need CUDA (streams, torch.cuda calls, a CUDA backend): the CPU
# run of the plan (tests/test_gpu_check.py) leaves them out.
CUDA_ONLY = {c.async_and_streams, c.off_the_current_device, layers.backend_every_op,
             layers.backend_streams}
