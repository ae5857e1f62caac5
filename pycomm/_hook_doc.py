"""The shared parts of pycomm.hooks' docstrings: every hook takes (state,
bucket) and fails the same way, every wrapper takes a hook; these decorators
write that part of each docstring from one text."""

from __future__ import annotations

from typing import Any, Callable, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

# Every hook takes (state, bucket) and fails the same way: _hook_doc writes
# that part of each hook's docstring from this one text.
_HOOK_DOC = """
    Args:
        state: {state}
        bucket: {bucket}

    Returns:
        {returns}

    Raises:
        TypeError: ``state`` holds no Communicator{not_dtype}.
        ValueError: the bucket is not on the communicator's device.
"""
_STATE = "a :class:`pycomm.Communicator` (or an object with ``.comm``)."
_FLOAT32_BUCKET = "DDP's gradient bucket (float32); overwritten with the average."
_FLOAT_BUCKET = ("DDP's gradient bucket (float32, bfloat16 or float16); overwritten with the "
                 "average.")

_WRAPPER_DOC = """
    Args:
        hook: a hook ``(state, bucket) -> Future[Tensor]``.

    Returns:
        The wrapped hook, registered with the same state as ``hook``.
"""


def _with_doc(shared: str) -> Callable[[F], F]:
    """Puts ``shared`` (Args/Returns/Raises) into the decorated function's
    docstring, before its ``Example::`` (else at its end)."""

    def apply(fn: F) -> F:
        doc = fn.__doc__ or ""
        if "    Example::" in doc:
            doc = doc.replace("    Example::", shared.lstrip("\n") + "\n    Example::", 1)
        else:
            doc = doc.rstrip() + "\n" + shared
        fn.__doc__ = doc
        return fn

    return apply


def _hook_doc(bucket: str, returns: str, *, state: str = _STATE,
              needs: str | None = None) -> Callable[[F], F]:
    """A hook's Args/Returns/Raises, from :data:`_HOOK_DOC`; ``needs``: the
    bucket dtypes it takes, where it does not take every one."""
    return _with_doc(_HOOK_DOC.format(
        state=state, bucket=bucket, returns=returns,
        not_dtype=f", or the bucket is not {needs}" if needs else ""))
