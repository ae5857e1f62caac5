"""Which CUDA device an nccl communicator runs on (pycomm._setup.choose_cuda_index
and cuda_device): an explicit index, else cuda:LOCAL_RANK, else the caller's
current device; never torch.cuda.set_device. Pure logic: runs without a GPU
(torch.cuda is replaced by a fake where the wrapper is tested)."""

from __future__ import annotations

import pytest
import torch

from pycomm._setup import choose_cuda_index, cuda_device


def _no_current() -> int:
    raise AssertionError("current_device() must not be consulted here")


@pytest.mark.parametrize(
    "requested,local_rank,count,current,want",
    [
        (None, None, 4, 2, 2),      # nothing set: the caller's current device
        (None, "", 4, 3, 3),        # LOCAL_RANK empty counts as unset
        (None, "1", 4, 3, 1),       # torchrun: cuda:LOCAL_RANK
        (None, " 2 ", 4, 0, 2),     # surrounding blanks tolerated
        (3, "1", 4, 2, 3),          # an explicit index beats LOCAL_RANK ...
        (0, None, 4, 2, 0),         # ... and the current device
    ],
)
def test_choice_order(requested, local_rank, count, current, want):
    assert choose_cuda_index(requested, local_rank, count, lambda: current) == want


def test_explicit_index_and_local_rank_do_not_ask_the_current_device():
    assert choose_cuda_index(1, None, 2, _no_current) == 1
    assert choose_cuda_index(None, "0", 2, _no_current) == 0


@pytest.mark.parametrize(
    "requested,local_rank,count,current,match",
    [
        (None, "4", 4, 0, r"LOCAL_RANK=4 .*there is no cuda:4 \(4 CUDA device"),
        (5, None, 2, 0, r"device=cuda:5: there is no cuda:5 \(2 CUDA device"),
        (None, None, 1, 1, r"current_device\(\)=1: there is no cuda:1"),
        (None, "-1", 2, 0, r"LOCAL_RANK=-1 .*there is no cuda:-1"),
        (None, "one", 2, 0, r"LOCAL_RANK='one' is not an integer"),
    ],
)
def test_bad_choices_raise_value_error(requested, local_rank, count, current, match):
    with pytest.raises(ValueError, match=match):
        choose_cuda_index(requested, local_rank, count, lambda: current)


class _FakeCuda:
    """torch.cuda's device queries, 3 devices, current device 2; set_device fails."""

    def __init__(self, monkeypatch):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)
        monkeypatch.setattr(torch.cuda, "set_device", self._set_device)

    @staticmethod
    def _set_device(*args):
        raise AssertionError("init must not call torch.cuda.set_device")


@pytest.mark.parametrize(
    "device,local_rank,want",
    [
        (None, None, 2),
        (torch.device("cuda"), None, 2),
        (None, "1", 1),
        (torch.device("cuda"), "0", 0),
        (torch.device("cuda", 1), "0", 1),
    ],
)
def test_cuda_device_wrapper(monkeypatch, device, local_rank, want):
    _FakeCuda(monkeypatch)
    if local_rank is None:
        monkeypatch.delenv("LOCAL_RANK", raising=False)
    else:
        monkeypatch.setenv("LOCAL_RANK", local_rank)
    assert cuda_device(device) == torch.device("cuda", want)


def test_cuda_device_without_cuda_says_so(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="torch.cuda.is_available.. is False"):
        cuda_device(None)

