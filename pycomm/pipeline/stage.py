"""One pipeline stage: a module, its place in the pipeline, and the state it
keeps between a microbatch's forward and backward."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from ..comm import Communicator
from ._wire import as_tuple

__all__ = ["CHECKPOINT_MODES", "PipelineStage"]

CHECKPOINT_MODES = ("never", "except_last", "always")


@dataclass
class _Microbatch:
    """What one microbatch's backward needs."""

    inputs: tuple[torch.Tensor, ...]        # leaves (floating ones require grad)
    outputs: tuple[torch.Tensor, ...] | None  # attached to the graph; None if checkpointed
    loss: torch.Tensor | None               # last stage: attached loss (None if checkpointed)
    target: Any = None                      # last stage, checkpointed: to recompute the loss
    rng_state: torch.Tensor | None = None   # checkpointed: to replay dropout exactly
    cuda_rng_state: torch.Tensor | None = None
    saved_bytes: int = 0


class PipelineStage:
    """A stage of a pipeline: ``module`` runs stage ``stage_index`` of
    ``num_stages`` on this rank, talking to its neighbours over ``comm``.

    The schedules drive it; users only build it. The stage's parameters keep
    their gradients in ``.grad`` (accumulated, as after ``loss.backward()``).

    Args:
        module: the stage's layers; called as ``module(*inputs)`` where
            ``inputs`` are the previous stage's outputs (a tensor or a tuple)
            or, on stage 0, the microbatch of ``step``'s arguments.
        stage_index: this stage's index, 0 .. num_stages - 1.
        num_stages: stages in the pipeline (with interleaving, all of them).
        comm: the communicator of the pipeline's ranks; stage s runs on rank
            ``s % comm.world_size``.
        device: where the module and received tensors live (default: the
            communicator's device). The module is moved there.
        checkpoint: activation recomputation, as in torchgpipe: ``"never"``
            keeps every microbatch's activations until its backward;
            ``"always"`` keeps only the inputs and reruns the forward during
            backward; ``"except_last"`` does that for all but the last
            microbatch.

    Attributes:
        peak_live_microbatches: the most microbatches whose forward had run
            and whose backward had not, at any time since construction (or
            :meth:`reset_memory_stats`).
        peak_live_bytes: the most bytes saved for backward at once (tensors
            autograd saved, plus checkpointed inputs).

    Raises:
        ValueError: stage_index outside 0 .. num_stages - 1, a stage on the
            wrong rank, or an unknown checkpoint mode.
        TypeError: module is not an ``nn.Module`` or comm not a Communicator.

    Example::

        >>> comm = pycomm.init()
        >>> stages = split_sequential(model, comm.world_size)
        >>> stage = PipelineStage(stages[comm.rank], comm.rank, comm.world_size, comm)
        >>> schedule = Schedule1F1B(stage, n_microbatches=8, loss_fn=nn.functional.mse_loss)
    """

    def __init__(self, module: nn.Module, stage_index: int, num_stages: int,
                 comm: Communicator, device: torch.device | str | None = None,
                 checkpoint: str = "never") -> None:
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be an nn.Module, got {type(module).__name__}")
        if not isinstance(comm, Communicator):
            raise TypeError(f"comm must be a pycomm.Communicator, got {type(comm).__name__}")
        for name, v in (("num_stages", num_stages), ("stage_index", stage_index)):
            if not isinstance(v, int) or isinstance(v, bool):
                raise TypeError(f"{name} must be an int, got {v!r}")
        if num_stages < 1 or not 0 <= stage_index < num_stages:
            raise ValueError(f"stage_index must be in 0 .. num_stages - 1 = {num_stages - 1}, "
                             f"got {stage_index}")
        if num_stages % comm.world_size:
            raise ValueError(f"num_stages ({num_stages}) must be a multiple of the "
                             f"communicator's world_size ({comm.world_size})")
        if stage_index % comm.world_size != comm.rank:
            raise ValueError(f"stage {stage_index} belongs on rank "
                             f"{stage_index % comm.world_size}, not rank {comm.rank} "
                             "(stage s runs on rank s % world_size)")
        if checkpoint not in CHECKPOINT_MODES:
            raise ValueError(f"checkpoint must be one of {CHECKPOINT_MODES}, got {checkpoint!r}")
        self.device = torch.device(device) if device is not None else comm.device
        self.submod = module.to(self.device)
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.comm = comm
        self.checkpoint = checkpoint
        self._mbs: dict[int, _Microbatch] = {}
        # Whether the module returned a tensor (not a tuple) in its last forward.
        self.returns_tensor = True
        self._live_bytes = 0
        self.reset_memory_stats()

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1

    @property
    def live_microbatches(self) -> int:
        """Microbatches whose activations are alive now."""
        return len(self._mbs)

    def reset_memory_stats(self) -> None:
        """Restarts the peak counters from the current state."""
        self.peak_live_microbatches = len(self._mbs)
        self.peak_live_bytes = self._live_bytes

    def discard_microbatches(self) -> None:
        """Drops the activations of microbatches whose backward will not run
        (the schedules call it when a step fails)."""
        self._mbs.clear()
        self._live_bytes = 0

    def __repr__(self) -> str:
        return (f"PipelineStage(stage_index={self.stage_index}, num_stages={self.num_stages}, "
                f"rank={self.comm.rank}, checkpoint={self.checkpoint!r})")

    # -- driven by the schedules ------------------------------------------------
    def _checkpointed(self, mb: int, n_microbatches: int) -> bool:
        return self.checkpoint == "always" or (
            self.checkpoint == "except_last" and mb < n_microbatches - 1)

    def forward_microbatch(self, mb: int, inputs: tuple[torch.Tensor, ...], n_microbatches: int,
                           loss_fn: Callable[..., torch.Tensor] | None = None,
                           target: Any = None
                           ) -> tuple[tuple[torch.Tensor, ...], torch.Tensor | None]:
        """Runs the forward of microbatch `mb`. Returns the outputs (detached,
        as a tuple) and, on the last stage, the loss (detached)."""
        if mb in self._mbs:
            raise RuntimeError(f"stage {self.stage_index}: forward of microbatch {mb} ran twice "
                               "without its backward")
        # Leaves of this stage's graph; floating ones collect the gradient
        # that goes back to the previous stage.
        leaves = tuple(x.detach().requires_grad_(x.is_floating_point() and not self.is_first)
                       for x in inputs)
        state = _Microbatch(leaves, None, None)
        if self._checkpointed(mb, n_microbatches):
            state.rng_state = torch.get_rng_state()
            if self.device.type == "cuda":
                state.cuda_rng_state = torch.cuda.get_rng_state(self.device)
            state.target = target
            with torch.no_grad():
                out, loss = self._run(leaves, loss_fn, target)
            state.saved_bytes = sum(x.numel() * x.element_size() for x in leaves)
        else:
            def count(t: torch.Tensor) -> torch.Tensor:
                state.saved_bytes += t.numel() * t.element_size()
                return t
            with torch.autograd.graph.saved_tensors_hooks(count, lambda t: t):
                out, loss = self._run(leaves, loss_fn, target)
            state.outputs = as_tuple(out, f"stage {self.stage_index}'s output")
            state.loss = loss
        self._mbs[mb] = state
        self._live_bytes += state.saved_bytes
        self.peak_live_microbatches = max(self.peak_live_microbatches, len(self._mbs))
        self.peak_live_bytes = max(self.peak_live_bytes, self._live_bytes)
        self.returns_tensor = isinstance(out, torch.Tensor)
        outs = tuple(t.detach() for t in as_tuple(out, f"stage {self.stage_index}'s output"))
        return outs, (loss.detach() if loss is not None else None)

    def _run(self, leaves: tuple[torch.Tensor, ...], loss_fn: Callable[..., torch.Tensor] | None,
             target: Any) -> tuple[Any, torch.Tensor | None]:
        out = self.submod(*leaves)
        if not self.is_last:
            return out, None
        assert loss_fn is not None  # the schedule passes it to the last stage
        loss = loss_fn(out, target)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError("loss_fn must return a scalar tensor, got "
                             f"{type(loss).__name__} {getattr(loss, 'shape', '')}")
        return out, loss

    def backward_microbatch(self, mb: int, grads: tuple[torch.Tensor, ...] | None,
                            loss_fn: Callable[..., torch.Tensor] | None = None,
                            loss_scale: float = 1.0) -> tuple[torch.Tensor, ...] | None:
        """Runs the backward of microbatch `mb` and frees its activations.

        Args:
            grads: gradients of the floating outputs, in order (not on the
                last stage, whose root is ``loss * loss_scale``).

        Returns:
            The gradients of the floating inputs (zeros where an input was
            unused), or None on the first stage.
        """
        state = self._mbs.pop(mb)
        self._live_bytes -= state.saved_bytes
        buffers: list[torch.Tensor] = []
        if state.outputs is None and state.loss is None:  # checkpointed: recompute
            # The forward already counted this microbatch in the running
            # statistics (BatchNorm); the recomputation must not count it again
            # (put back after the backward, which may need the buffers' version).
            buffers = [b.clone() for b in self.submod.buffers()]
            assert state.rng_state is not None  # saved by a checkpointed forward
            cuda_rng = state.cuda_rng_state
            cuda = [self.device] if cuda_rng is not None else []
            with torch.random.fork_rng(devices=cuda):
                torch.set_rng_state(state.rng_state)
                if cuda_rng is not None:
                    torch.cuda.set_rng_state(cuda_rng, self.device)
                with torch.enable_grad():
                    out, state.loss = self._run(state.inputs, loss_fn, state.target)
            state.outputs = as_tuple(out, f"stage {self.stage_index}'s output")
        roots: list[torch.Tensor]
        root_grads: list[torch.Tensor | None]
        if self.is_last:
            assert state.loss is not None  # attached, or recomputed above
            roots, root_grads = [state.loss * loss_scale], [None]
        else:
            assert state.outputs is not None  # attached, or recomputed above
            floats = [t for t in state.outputs if t.is_floating_point()]
            assert grads is not None and len(grads) == len(floats)
            pairs = [(t, g) for t, g in zip(floats, grads) if t.requires_grad]
            roots, root_grads = [p[0] for p in pairs], [p[1] for p in pairs]
        if roots:
            torch.autograd.backward(roots, root_grads)
        with torch.no_grad():
            for buf, saved in zip(self.submod.buffers(), buffers):
                buf.copy_(saved)
        if self.is_first:
            return None
        return tuple(x.grad if x.grad is not None else torch.zeros_like(x)
                     for x in state.inputs if x.is_floating_point())
