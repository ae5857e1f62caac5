"""The pipeline schedules and the runtime that executes their action lists.

The runtime knows no schedule: it walks this rank's list from
``_actions.py`` and runs each action. Communication of one phase (the
transfers of tensors produced at one clock tick) goes out as three batches::

    phase t on every rank, after its computation of tick t:
      (1) post  A = activation headers: sends, and receives          (batch)
      (2) post  B = gradient sends and receives, activation payload sends
          (a phase that receives no header posts A and B as one batch, A
          first)
    later, before the first computation that consumes one of A's
    activations, or before this rank next posts a receive from the same
    peer (whichever comes first):
      (3) wait  A, size the buffers
      (4) post  C = activation payload receives
    before a computation: wait for the B/C receives it consumes.
    end of step: wait for everything still in flight.

(3) waits as late as that so that a rank whose next computation does not
need the header (1F1B with ``slack``) computes instead of waiting for its
neighbour to produce it.

Why this cannot deadlock. Both ends of a transfer carry it in the *same*
phase, and both post in the same order (headers, then gradients, then
payloads, each by ``_comm_key``; the receiver posts C of an earlier phase
before any later receive from that peer), so messages between two ranks
match in posting order. The only blocking waits are (3) and the wait before
a computation. Induction on t: suppose every rank has posted the sends of
all phases < t. A computation at tick t consumes tensors produced at ticks
< t, whose headers and payloads have been sent; the rank posts the matching
receives in order ((3) waits for a header of a phase < t), so it finishes.
A wait (3) at phase t is for a header of a phase < t too (its own headers
are posted after it), so it finishes. Every rank thus posts the sends of
phase t, for every t, and, consuming every activation it receives, posts
every receive: the step ends. Batching sends with receives
(``batch_isend_irecv``) means no order of posts within a phase can block,
whatever the transport buffers.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Sequence

import torch

from ..comm import Communicator, P2POp, ReduceOp, Work
from . import _actions
from ._actions import Action, Kind
from ._wire import (
    HEADER_LEN,
    TensorMeta,
    as_tuple,
    decode_header,
    encode_header,
    from_wire,
    meta_of,
    to_wire,
    wire_buffer,
)
from .stage import PipelineStage

__all__ = ["PipelineSchedule", "Schedule1F1B", "ScheduleGPipe", "ScheduleInterleaved1F1B",
           "split_microbatches"]

LossFn = Callable[[Any, Any], torch.Tensor]


def split_microbatches(value: Any, n_microbatches: int, what: str) -> list[Any]:
    """Splits a tensor (or a tuple/list of tensors) on dim 0 like
    ``tensor.chunk(n_microbatches)``: the last microbatch may be smaller.

    Raises:
        ValueError: the batch yields fewer than n_microbatches chunks
            (chunk's rule: fewer rows than microbatches, or e.g. 5 rows in 4).
    """
    if isinstance(value, (tuple, list)):
        parts = [split_microbatches(v, n_microbatches, f"{what}[{k}]") for k, v in enumerate(value)]
        return [tuple(p[i] for p in parts) for i in range(n_microbatches)]
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        raise TypeError(f"{what} must be a tensor with a batch dimension (or a tuple of them), "
                        f"got {type(value).__name__}")
    chunks = value.chunk(n_microbatches)
    if len(chunks) != n_microbatches:
        raise ValueError(f"{what} has {value.shape[0]} rows, which tensor.chunk splits into "
                         f"{len(chunks)} microbatches, not n_microbatches={n_microbatches}; use "
                         "a batch size that gives n_microbatches chunks (e.g. a multiple)")
    return list(chunks)


def _merge(outputs: list[tuple[torch.Tensor, ...]], single: bool) -> Any:
    cat = tuple(torch.cat(parts) for parts in zip(*outputs))
    return cat[0] if single else cat


class PipelineSchedule:
    """Runs the action lists of a schedule on this rank's stages.

    Use :class:`ScheduleGPipe`, :class:`Schedule1F1B` or
    :class:`ScheduleInterleaved1F1B`.
    """

    def __init__(self, stages: Sequence[PipelineStage], n_microbatches: int, loss_fn: LossFn,
                 actions: Callable[[int, int, int], list[list[Action]]],
                 dp_comm: Communicator | None = None) -> None:
        if not isinstance(n_microbatches, int) or isinstance(n_microbatches, bool) \
                or n_microbatches < 1:
            raise ValueError(f"n_microbatches must be an int >= 1, got {n_microbatches!r}")
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable (output, target) -> loss, got {loss_fn!r}")
        if dp_comm is not None and not isinstance(dp_comm, Communicator):
            raise TypeError(f"dp_comm must be a pycomm.Communicator or None, got "
                            f"{type(dp_comm).__name__}")
        self._stages = {s.stage_index: s for s in stages}
        first = stages[0]
        self.comm = first.comm
        self.num_stages = first.num_stages
        self.n_microbatches = n_microbatches
        self.loss_fn = loss_fn
        self.dp_comm = dp_comm
        world = self.comm.world_size
        self.actions = actions(self.num_stages, world, n_microbatches)[self.comm.rank]

    # -- public ---------------------------------------------------------------
    def step(self, *args: Any, target: Any = None, losses: list | None = None) -> Any:
        """Runs one training step's forward and backward over all microbatches.

        The rank holding stage 0 passes the batch (``args``, each split on
        dim 0 like ``tensor.chunk``); the rank holding the last stage passes
        ``target`` (split the same way) and, optionally, a list ``losses`` that
        gets the per-microbatch losses appended; other ranks call ``step()``.
        Afterwards every stage's parameters hold (accumulate into ``.grad``)
        the gradient of the mean over microbatches of ``loss_fn(output_i,
        target_i)``; with ``dp_comm``, averaged over the data-parallel replicas.

        Returns:
            On the last stage's rank, the outputs of all microbatches
            concatenated on dim 0; None elsewhere.

        Raises:
            ValueError: inputs on a rank without stage 0, a missing target on
                the last stage, or a batch that does not split into
                n_microbatches chunks.
        """
        m = self.n_microbatches
        first, last = self._stages.get(0), self._stages.get(self.num_stages - 1)
        if first is None and args:
            raise ValueError(f"rank {self.comm.rank} holds no stage 0: only the first stage's "
                             "rank passes inputs to step(); call step() here")
        if first is not None and not args:
            raise ValueError("the rank holding stage 0 must pass the batch: step(inputs, ...)")
        if last is None and (target is not None or losses is not None):
            raise ValueError(f"rank {self.comm.rank} holds no last stage: target and losses "
                             "belong on the last stage's rank")
        if last is not None and target is None:
            raise ValueError("the rank holding the last stage must pass target=... to step()")
        run = _Run(self, split_microbatches(args, m, "step's inputs") if args else None,
                   split_microbatches(target, m, "target") if last is not None else None)
        try:
            run.execute(self.actions)
        except BaseException:
            # The step is lost: free its activations, so that the next step
            # starts clean (not with "forward ... ran twice").
            for stage in self._stages.values():
                stage.discard_microbatches()
            raise
        if self.dp_comm is not None:
            _average_gradients([s.submod for s in self._stages.values()], self.dp_comm)
        if last is None:
            return None
        if losses is not None:
            losses.extend(run.losses[i] for i in range(m))
        return _merge([run.last_outputs[i] for i in range(m)], run.single_output)

    def format(self) -> str:
        """This rank's action list, one action per line."""
        return "\n".join(str(a) for a in self.actions)


class _Run:
    """The state of one step on one rank (see the module docstring)."""

    def __init__(self, sched: PipelineSchedule, inputs: list | None, targets: list | None) -> None:
        self.s = sched
        self.inputs = inputs
        self.targets = targets
        self.loss_scale = 1.0 / sched.n_microbatches
        self.acts: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}   # produced (stage, mb)
        self.grads: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}  # produced input grads
        # received, not yet consumed: (stage, mb) -> (work, metas, buffers)
        # (Work None: nothing to receive, e.g. no gradient for integer outputs)
        self.recv_acts: dict[tuple[int, int],
                             tuple[Work | None, tuple[TensorMeta, ...], list]] = {}
        self.recv_grads: dict[tuple[int, int], tuple[Work | None, list]] = {}
        # header batches posted, payload receives not yet (step 3, deferred):
        # (work, [(stage, mb), peer, header]), in posting order
        self.headers: list[tuple[Work, list[tuple[tuple[int, int], int, torch.Tensor]]]] = []
        self.in_flight: list[tuple[Work, list]] = []  # sends: keep buffers alive
        self.losses: dict[int, torch.Tensor] = {}
        self.last_outputs: dict[int, tuple[torch.Tensor, ...]] = {}
        self.out_metas: dict[tuple[int, int], tuple[TensorMeta, ...]] = {}
        self.single_output = True

    def execute(self, actions: list[Action]) -> None:
        k = 0
        while k < len(actions):
            a = actions[k]
            if a.is_compute:
                (self.forward if a.kind is Kind.FORWARD else self.backward)(a)
                k += 1
                continue
            j = k
            while j < len(actions) and not actions[j].is_compute and actions[j].tick == a.tick:
                j += 1
            self.phase(actions[k:j])
            k = j
        for work, _ in self.in_flight:  # sends (every receive was consumed)
            work.wait()
        self.in_flight.clear()

    # -- computations -----------------------------------------------------------
    def forward(self, a: Action) -> None:
        stage = self.s._stages[a.stage]
        key = (a.stage, a.microbatch)
        if stage.is_first:
            assert self.inputs is not None  # step() checked the first stage's batch
            inputs = as_tuple(self.inputs[a.microbatch], "step's inputs")
        elif key in self.recv_acts or any(key == k for _, b in self.headers for k, _, _ in b):
            while key not in self.recv_acts:
                self._receive_payloads()
            work, metas, bufs = self.recv_acts.pop(key)
            _wait_received(work)
            inputs = tuple(from_wire(b, m) for b, m in zip(bufs, metas))
        else:  # the previous stage is on this rank
            inputs = self.acts.pop((a.stage - 1, a.microbatch))
        target = None
        if stage.is_last:
            assert self.targets is not None  # step() checked the last stage's target
            target = self.targets[a.microbatch]
        outs, loss = stage.forward_microbatch(a.microbatch, inputs, self.s.n_microbatches,
                                              self.s.loss_fn, target)
        self.out_metas[key] = meta_of(outs, f"stage {a.stage}'s output")
        if stage.is_last:
            assert loss is not None  # the last stage computes one
            self.losses[a.microbatch] = loss
            self.last_outputs[a.microbatch] = outs
            self.single_output = stage.returns_tensor
        else:
            self.acts[key] = outs

    def backward(self, a: Action) -> None:
        stage = self.s._stages[a.stage]
        key = (a.stage, a.microbatch)
        grads = None
        if not stage.is_last:
            if key in self.recv_grads:
                work, bufs = self.recv_grads.pop(key)
                _wait_received(work)
                grads = tuple(bufs)
            else:
                grads = self.grads.pop((a.stage + 1, a.microbatch))
        in_grads = stage.backward_microbatch(a.microbatch, grads, self.s.loss_fn, self.loss_scale)
        if in_grads is not None:
            self.grads[key] = in_grads

    # -- one communication phase (steps 1-4 of the module docstring) -------------
    def phase(self, acts: list[Action]) -> None:
        comm, device = self.s.comm, self.s._stages[acts[0].stage].device
        headers: list[P2POp] = []
        grads_and_sends: list[P2POp] = []
        payload_sends: list[P2POp] = []
        header_recvs: list[tuple[tuple[int, int], int, torch.Tensor]] = []
        grad_recvs: list[tuple[tuple[int, int], list[torch.Tensor]]] = []
        keep: list[torch.Tensor] = []
        for a in acts:  # already in _comm_key order: gradients, then activations
            key = (a.stage, a.microbatch)
            if a.kind is Kind.SEND_F:
                outs = self.acts.pop(key)
                h = encode_header(self.out_metas[key], f"stage {a.stage}'s output").to(comm.device)
                headers.append(P2POp("isend", h, a.peer))
                wire = [to_wire(t) for t in outs]
                payload_sends += [P2POp("isend", t, a.peer) for t in wire]
                keep += [h, *wire]
            elif a.kind is Kind.RECV_F:
                h = torch.empty(HEADER_LEN, dtype=torch.int64, device=comm.device)
                headers.append(P2POp("irecv", h, a.peer))
                header_recvs.append((key, a.peer, h))
            elif a.kind is Kind.SEND_B:
                wire = [to_wire(g) for g in self.grads.pop(key)]
                grads_and_sends += [P2POp("isend", g, a.peer) for g in wire]
                keep += wire
            else:  # RECV_B: gradients of this stage's floating outputs
                bufs = [torch.empty(m.shape, dtype=m.dtype, device=device)
                        for m in self.out_metas[key] if m.carries_grad]
                grad_recvs.append((key, bufs))
                grads_and_sends += [P2POp("irecv", b, a.peer) for b in bufs]
        grads_and_sends += payload_sends
        # Receives from a peer match its messages in posting order: the
        # payload receives of earlier headers from it go first.
        peers = {op.peer for op in headers + grads_and_sends if not op.is_send()}
        while any(p in peers for _, b in self.headers for _, p, _ in b):
            self._receive_payloads()
        if header_recvs:
            header_work = self._post(headers, keep)
            rest_work = self._post(grads_and_sends, keep)
        else:  # nothing to wait for in (3): A and B go out as one batch, A first
            header_work = None
            rest_work = self._post(headers + grads_and_sends, keep)
        for key, bufs in grad_recvs:
            self.recv_grads[key] = (rest_work, bufs)
        if header_recvs:
            assert header_work is not None  # header_recvs were posted with it
            self.headers.append((header_work, header_recvs))

    def _receive_payloads(self) -> None:
        """Steps 3-4 for the oldest header batch: waits for it, sizes the
        buffers, posts the payload receives."""
        header_work, header_recvs = self.headers.pop(0)
        device = self.s._stages[header_recvs[0][0][0]].device
        header_work.wait()
        payload_recvs: list[P2POp] = []
        pending = []
        for key, peer, h in header_recvs:
            metas = decode_header(h)
            bufs = [wire_buffer(m, device) for m in metas]
            payload_recvs += [P2POp("irecv", b, peer) for b in bufs]
            pending.append((key, metas, bufs))
        work = self._post(payload_recvs, [])
        for key, metas, bufs in pending:
            self.recv_acts[key] = (work, metas, bufs)

    def _post(self, ops: list[P2POp], keep: list[torch.Tensor]) -> Work | None:
        if not ops:
            return None
        # Drop finished sends, so that a sent activation is freed with its
        # backward rather than at the end of the step (wait() raises a
        # transfer's error, if any).
        still = []
        for w, k in self.in_flight:
            if w.is_completed():
                w.wait()
            else:
                still.append((w, k))
        self.in_flight = still
        work = self.s.comm.batch_isend_irecv(ops)[0]
        if any(op.is_send() for op in ops):
            # The communicator's worker thread moves these sends; let it run
            # now rather than when the next computation gives up the core (on
            # a machine with a core per rank it otherwise waits up to a time
            # slice, milliseconds, and the peer with it: benchmarks/pipeline).
            os.sched_yield()
        self.in_flight.append((work, keep))
        return work


def _wait_received(work: Work | None) -> None:
    """Waits for a receive; None when it carried no tensor (a stage whose
    outputs are all integer gets no gradient back, so nothing was posted)."""
    if work is not None:
        work.wait()


def _average_gradients(modules: list[torch.nn.Module], dp_comm: Communicator) -> None:
    """Averages the gradients of `modules` over `dp_comm` (one flat all-reduce)."""
    if dp_comm.world_size == 1:
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for mod in modules:
        for p in mod.parameters():
            if p.grad is not None:
                by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
    for dtype in sorted(by_dtype, key=str):  # the same order on every replica
        grads = by_dtype[dtype]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dp_comm.all_reduce(flat, op=ReduceOp.AVG)
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()


# ------------------------------------------------------------------ the schedules

def _single(stage: PipelineStage, cls: str) -> list[PipelineStage]:
    if not isinstance(stage, PipelineStage):
        raise TypeError(f"{cls} takes one PipelineStage, got {type(stage).__name__}"
                        + (" (use ScheduleInterleaved1F1B for several stages per rank)"
                           if isinstance(stage, (list, tuple)) else ""))
    if stage.num_stages != stage.comm.world_size:
        raise ValueError(f"{cls} runs one stage per rank: num_stages ({stage.num_stages}) must "
                         f"equal the world size ({stage.comm.world_size}); use "
                         "ScheduleInterleaved1F1B for several stages per rank")
    return [stage]


class ScheduleGPipe(PipelineSchedule):
    """GPipe: all microbatches' forwards, then all backwards. Keeps every
    microbatch's activations until its backward (``n_microbatches`` at peak).

    Args:
        stage: this rank's :class:`PipelineStage` (one stage per rank).
        n_microbatches: microbatches per step, any int >= 1 (fewer than
            stages is allowed; the batch splits like ``tensor.chunk``).
        loss_fn: ``loss_fn(output, target) -> scalar`` on the last stage.
        dp_comm: optional data-parallel communicator over the replicas of this
            stage; gradients are averaged over it after each step.

    Example::

        >>> schedule = ScheduleGPipe(stage, n_microbatches=4, loss_fn=F.cross_entropy)
        >>> if stage.is_first: schedule.step(x)
        >>> elif stage.is_last: losses = []; schedule.step(target=y, losses=losses)
        >>> else: schedule.step()
    """

    def __init__(self, stage: PipelineStage, n_microbatches: int, loss_fn: LossFn,
                 dp_comm: Communicator | None = None) -> None:
        super().__init__(_single(stage, "ScheduleGPipe"), n_microbatches, loss_fn,
                         lambda p, w, m: _actions.gpipe(p, m), dp_comm)


class Schedule1F1B(PipelineSchedule):
    """1F1B: after ``num_stages - stage_index - 1`` warm-up forwards, each
    stage alternates one forward and one backward, so stage s keeps at most
    ``num_stages - s`` microbatches of activations. Any ``n_microbatches >=
    1``. Arguments as :class:`ScheduleGPipe`, and:

    Args:
        slack: extra warm-up forwards on every stage but the last (each
            keeps ``slack`` more microbatches of activations). Plain 1F1B
            (0) has no slack between neighbours: transfer latency and
            computations that run longer on one rank than on its neighbour
            show up as bubble. ``slack=1`` absorbs them, at the memory of one
            microbatch (``_actions.one_f_one_b``).

    Example::

        >>> schedule = Schedule1F1B(stage, n_microbatches=8, loss_fn=F.mse_loss)
        >>> schedule.step(x) if stage.is_first else schedule.step(target=y)
    """

    def __init__(self, stage: PipelineStage, n_microbatches: int, loss_fn: LossFn,
                 dp_comm: Communicator | None = None, slack: int = 0) -> None:
        super().__init__(_single(stage, "Schedule1F1B"), n_microbatches, loss_fn,
                         lambda p, w, m: _actions.one_f_one_b(p, m, slack), dp_comm)


class ScheduleInterleaved1F1B(PipelineSchedule):
    """Interleaved 1F1B: each rank holds several stages (rank r: stages r,
    r + world_size, ...), which shrinks the bubble by that factor.

    Args:
        stages: this rank's stages, a list of :class:`PipelineStage`.
        n_microbatches, loss_fn, dp_comm: as :class:`ScheduleGPipe`.

    Raises:
        ValueError: the list is not exactly this rank's stages.

    Example::

        >>> parts = split_sequential(model, 2 * comm.world_size)
        >>> mine = [PipelineStage(parts[s], s, len(parts), comm)
        ...         for s in range(comm.rank, len(parts), comm.world_size)]
        >>> schedule = ScheduleInterleaved1F1B(mine, n_microbatches=8, loss_fn=F.mse_loss)
    """

    def __init__(self, stages: Sequence[PipelineStage], n_microbatches: int, loss_fn: LossFn,
                 dp_comm: Communicator | None = None) -> None:
        if isinstance(stages, PipelineStage):
            stages = [stages]
        stages = list(stages)
        if not stages or not all(isinstance(s, PipelineStage) for s in stages):
            raise TypeError("stages must be a non-empty list of PipelineStage")
        comm, p = stages[0].comm, stages[0].num_stages
        want = list(range(comm.rank, p, comm.world_size))
        got = sorted(s.stage_index for s in stages)
        if got != want or any(s.comm is not comm or s.num_stages != p for s in stages):
            raise ValueError(f"rank {comm.rank} must pass exactly its stages {want} (of "
                             f"{p}, same communicator); got {got}")
        super().__init__(sorted(stages, key=lambda s: s.stage_index), n_microbatches, loss_fn,
                         _actions.interleaved_1f1b, dp_comm)
