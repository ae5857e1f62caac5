"""Tests of pycomm.bench: flags, busbw factors, the sweep, data checking,
JSON schema, and one real --nproc 2 run (the cost model: test_model.py).
Never on time."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pycomm.bench import cli, report
from pycomm.bench import collectives as C

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------ CLI

@pytest.mark.parametrize("text,expected", [
    ("0", 0), ("8", 8), ("1K", 1024), ("1k", 1024), ("64M", 64 << 20), ("2G", 2 << 30),
    ("4KB", 4096), ("4KiB", 4096), ("1.5K", 1536), (512, 512),
])
def test_parse_size(text, expected):
    assert cli.parse_size(text) == expected


@pytest.mark.parametrize("bad", ["", "K", "1X", "-1", "1.3", "12 M B"])
def test_parse_size_rejects(bad):
    with pytest.raises(ValueError):
        cli.parse_size(bad)


def test_size_sweep_factor_inclusive():
    assert cli.size_sweep(1024, 64 << 20, 4) == [1024 << (2 * k) for k in range(9)]
    assert cli.size_sweep(8, 8, 2) == [8]
    assert cli.size_sweep(1, 10, 3) == [1, 3, 9]


def test_size_sweep_step():
    assert cli.size_sweep(0, 10, 0, 4) == [0, 4, 8]


@pytest.mark.parametrize("lo,hi,f,i", [(10, 1, 2, 0), (1, 10, 0.5, 0), (1, 10, 0, 0), (0, 10, 2, 0)])
def test_size_sweep_errors(lo, hi, f, i):
    with pytest.raises(ValueError):
        cli.size_sweep(lo, hi, f, i)


def test_parse_args_nccl_tests_flags():
    a = cli.parse_args(["allreduce", "-b", "1K", "-e", "64M", "-f", "4", "-w", "2", "-n", "7",
                        "-d", "half", "-o", "max", "-c", "0", "--algo", "ring, torch,ring",
                        "--transport", "gloo", "--nproc", "2"])
    assert a.sizes[0] == 1024 and a.sizes[-1] == 64 << 20 and len(a.sizes) == 9
    assert (a.warmup_iters, a.iters, a.dtype, a.op, a.check) == (2, 7, "float16", "max", 0)
    assert a.algo == ["ring", "torch"]  # order kept, repeats dropped
    assert (a.transport, a.nproc) == ("gloo", 2)


def test_parse_args_defaults():
    a = cli.parse_args(["broadcast"])
    assert a.sizes == [32 << 20] and a.algo == ["ring", "torch"] and a.op == "none"
    assert (a.iters, a.warmup_iters, a.check, a.dtype) == (20, 5, 1, "float32")


@pytest.mark.parametrize("argv", [
    ["allreduce", "--algo", "butterfly"],
    ["allreduce", "--algo", ""],
    ["allreduce", "--algo", "ring,bruck"],
    ["allgather", "--algo", "tree"],
    ["allreduce", "-b", "1Q"],
    ["allreduce", "-d", "complex64"],
    ["allreduce", "-o", "xor"],
    ["allreduce", "-o", "avg", "-d", "int32"],
    ["allreduce", "-c", "2"],
    ["allreduce", "-n", "0"],
    ["allreduce", "-b", "1M", "-e", "1K"],
    ["allreduce", "--nproc", "0"],
    ["alltoallv"],
    ["allreduce", "--wire", "int4"],
    ["allgather", "--wire", "int8"],
    ["allreduce", "--wire", "int8", "-o", "max"],
    ["allreduce", "--wire", "int8", "-d", "bf16"],
    ["allreduce", "--link-rate", "1gbit"],  # needs --hosts
    ["allreduce", "--hosts", "2", "--link-rate", "1gbps"],
    ["allreduce", "--hosts", "2", "--link-rate", "0bit"],
])
def test_parse_args_errors(argv, capsys):
    with pytest.raises(SystemExit) as e:
        cli.parse_args(argv)
    assert e.value.code == 2
    assert "error" in capsys.readouterr().err


def test_algo_all_is_every_algorithm_of_the_collective():
    assert cli.parse_args(["allreduce", "--algo", "all"]).algo == [
        "ring", "recursive_doubling", "halving_doubling", "tree", "auto", "torch"]
    # "all" expands in place; an algo named twice is measured once
    assert cli.parse_args(["allgather", "--algo", "torch,all"]).algo == [
        "torch", "ring", "bruck", "auto"]
    assert cli.parse_args(["broadcast", "--algo", "all"]).algo == ["ring", "auto", "torch"]


# ------------------------------------------------------------------ busbw, counts

@pytest.mark.parametrize("coll,n,factor", [
    ("allreduce", 2, 1.0), ("allreduce", 4, 1.5), ("allreduce", 1, 0.0), ("allreduce", 8, 1.75),
    ("reducescatter", 4, 0.75), ("allgather", 2, 0.5), ("broadcast", 8, 1.0), ("sendrecv", 2, 1.0),
    # nccl-tests: reduce 1 (as broadcast); gather, scatter, alltoall (n-1)/n
    ("reduce", 4, 1.0), ("gather", 4, 0.75), ("scatter", 2, 0.5), ("alltoall", 8, 0.875),
])
def test_busbw_factor(coll, n, factor):
    assert C.busbw_factor(coll, n) == pytest.approx(factor)


def test_busbw_factor_unknown():
    with pytest.raises(ValueError):
        C.busbw_factor("alltoallv", 2)


def test_counts_like_nccl_tests():
    assert C.counts("allreduce", 1024, 4, 3) == (256, 1024)
    assert C.counts("allreduce", 1023, 4, 3) == (255, 1020)
    # reduce-scatter / all-gather: count per rank, size of the whole buffer
    assert C.counts("reducescatter", 1024, 4, 3) == (85, 85 * 3 * 4)
    assert C.counts("allgather", 1024, 2, 2) == (256, 1024)


# ------------------------------------------------------------------ data and #wrong

def test_rank_values_small_ints_not_periodic():
    v = C.rank_values(0, 4096)
    assert v.min() >= 0 and v.max() <= 7
    assert not torch.equal(v[:2048], v[2048:])
    assert not torch.equal(v[:-8], v[8:])
    assert not torch.equal(C.rank_values(0, 64), C.rank_values(1, 64))
    p = C.rank_values(3, 100, op="prod")
    assert set(p.tolist()) <= {1, 2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16,
                                   torch.int32, torch.int64, torch.uint8, torch.int8])
@pytest.mark.parametrize("op", ["sum", "max", "min", "prod"])
def test_checker_accepts_true_allreduce_and_catches_corruption(dtype, op):
    n, count = 3, 1000
    inputs = [C.rank_values(r, count, op).to(dtype) for r in range(n)]
    # the "collective": computed in the dtype the way a library would
    acc = inputs[0].float() if dtype in (torch.float16, torch.bfloat16) else inputs[0].clone()
    for t in inputs[1:]:
        t = t.float() if dtype in (torch.float16, torch.bfloat16) else t
        acc = {"sum": torch.add, "max": torch.maximum, "min": torch.minimum, "prod": torch.mul}[op](acc, t)
    result = acc.to(dtype)
    expected = C.expected_result("allreduce", 0, n, count, dtype, op)
    assert C.count_wrong(result, expected) == 0
    bad = result.clone()
    bad[17] += 1
    bad[500] = bad[501] + 3
    assert C.count_wrong(bad, expected) == 2


def test_checker_avg_and_nan():
    n, count = 4, 64
    expected = C.expected_result("allreduce", 0, n, count, torch.float32, "avg")
    result = (sum(C.rank_values(r, count).float() for r in range(n)) / n).float()
    assert C.count_wrong(result, expected) == 0
    result[3] = float("nan")
    assert C.count_wrong(result, expected) == 1


def test_checker_catches_misplaced_chunk():
    # A ring bug that writes chunk 1 where chunk 0 belongs must not pass.
    n, count = 2, 4096
    expected = C.expected_result("allreduce", 0, n, count, torch.float32, "sum")
    wrong = expected.clone().float()
    half = count // 2
    wrong[:half] = wrong[half:].clone()
    assert C.count_wrong(wrong, expected) > half // 2


def test_expected_other_collectives():
    n, m = 3, 10
    rs = C.expected_result("reducescatter", 1, n, m, torch.float32, "sum")
    full = C.expected_result("allreduce", 0, n, n * m, torch.float32, "sum")
    assert torch.equal(rs, full[m:2 * m])
    ag = C.expected_result("allgather", 2, n, m, torch.int32, "none")
    assert torch.equal(ag[m:2 * m], C.rank_values(1, m))
    assert torch.equal(C.expected_result("broadcast", 2, n, m, torch.int32, "none", root=1),
                       C.rank_values(1, m))
    assert torch.equal(C.expected_result("sendrecv", 0, n, m, torch.int32, "none"), C.rank_values(2, m))


def test_expected_rooted_and_alltoall():
    n, m = 3, 5
    full = C.expected_result("allreduce", 0, n, m, torch.float32, "max")
    assert torch.equal(C.expected_result("reduce", 1, n, m, torch.float32, "max", root=1), full)
    assert C.expected_result("reduce", 0, n, m, torch.float32, "max", root=1).numel() == 0
    g = C.expected_result("gather", 2, n, m, torch.int32, "none", root=2)
    assert torch.equal(g, torch.cat([C.rank_values(r, m) for r in range(n)]))
    assert C.expected_result("gather", 0, n, m, torch.int32, "none", root=2).numel() == 0
    # scatter: rank 1 gets block 1 of the root's n*m input
    s = C.expected_result("scatter", 1, n, m, torch.int32, "none", root=2)
    assert torch.equal(s, C.rank_values(2, n * m)[m:2 * m])
    # alltoall: rank 1's block p is block 1 of rank p's input
    a = C.expected_result("alltoall", 1, n, m, torch.int32, "none")
    for p in range(n):
        assert torch.equal(a[p * m:(p + 1) * m], C.rank_values(p, n * m)[m:2 * m])
    assert C.counts("alltoall", 1024, 4, 4) == (64, 1024)


def test_count_wrong_size_mismatch():
    with pytest.raises(ValueError):
        C.count_wrong(torch.zeros(3), torch.zeros(4))


@pytest.mark.parametrize("coll,in_place", [("reducescatter", True), ("allgather", True),
                                           ("allgather", False), ("allreduce", True),
                                           ("reduce", True), ("gather", False),
                                           ("scatter", False), ("alltoall", False)])
def test_buffers_reset_poisons_output(coll, in_place):
    # rank 0 = the root of the rooted ones (only the root's result is checked)
    b = C.make_buffers(coll, in_place, 0, 2, 8, torch.float32, "sum", torch.device("cpu"))
    b.reset()
    exp = C.expected_result(coll, 0, 2, 8, torch.float32, "sum")
    # before the collective runs, the result must not already look right
    assert C.count_wrong(b.result, exp) > 0


# ------------------------------------------------------------------ table and JSON

def _row(**kw):
    r = {"collective": "allreduce", "size": 1024, "count": 256, "dtype": "float32", "op": "sum",
         "root": -1, "algo": "ring", "in_place": True, "time_us": 10.0, "algbw": 0.1024,
         "busbw": 0.1024, "wrong": 0, "world_size": 2, "transport": "gloo", "device": "cpu"}
    r.update(kw)
    r.setdefault("p50_us", r["time_us"])
    r.setdefault("p99_us", 1.5 * r["time_us"])
    return r


def test_table_format():
    hdr = report.format_header([("ring", True), ("torch", True)])
    assert "ring in-place" in hdr and "#wrong" in hdr and "algbw" in hdr
    line = report.format_row([_row(), None, _row(algo="torch", wrong=None)])
    assert line.split()[:5] == ["1024", "256", "float", "sum", "-1"]
    assert line.count("N/A") == 5
    summary = report.format_summary([_row(), _row(algo="torch", busbw=0.3, wrong=2)], ["ring", "torch"])
    assert "# Out of bounds values : 2 FAILED" in summary
    assert "# Avg bus bandwidth" in summary
    # ratios: ring 10 us vs torch 40 us and mpich 20 us at 1 KiB; at 4 KiB busbw 2 against
    # bounds of busbw 4 (one core) and 2.5 (every rank), left out of the averages
    rows = [_row(time_us=10.0), _row(algo="torch", time_us=40.0), _row(algo="mpich", time_us=20.0),
            _row(size=4096, time_us=20.0, busbw=2.0), _row(algo="torch", size=4096, time_us=30.0, busbw=1.0),
            _row(algo="copy-core", size=4096, busbw=4.0, wrong=None, bound=True, traffic_GBps=8.0),
            _row(algo="copy-ranks", size=4096, busbw=2.5, wrong=None, bound=True, traffic_GBps=5.0)]
    summary = report.format_summary(rows, ["ring", "torch", "mpich"])
    assert "# Speedup over torch (time ratio): 1K: ring 4.0x, mpich 2.0x; 4K: ring 1.5x" in summary
    assert "# Speedup over mpich (time ratio): 1K: ring 2.0x, torch 0.5x" in summary
    assert ("# busbw / copy-core busbw at 4K (copy traffic 8.00 GB/s read + written per rank): "
            "ring 50%, torch 25%") in summary
    assert ("# busbw / copy-ranks busbw at 4K (copy traffic 5.00 GB/s read + written per rank): "
            "ring 80%, torch 40%") in summary
    assert "#   copy" not in summary and "# Avg bus bandwidth    : 0.66144\n" in summary
    assert "copy" not in report.format_summary(rows[:5], ["ring", "torch", "mpich"])
    # the per-call spread of every algo at the smallest and largest size
    assert "# per-call p99 / p50 at 1K and 4K: ring 1.50 1.50, torch 1.50 1.50" in summary
    top = report.format_header([("ring", True), ("copy-ranks", None)]).splitlines()[0]
    assert top.endswith(" ring in-place" + " " * 24 + "copy-ranks")  # a bound has no placement


def test_json_schema_roundtrip(tmp_path):
    p = tmp_path / "r.json"
    report.write_json(str(p), {"world_size": 2}, [_row()])
    data = report.load_json(str(p))
    assert data["schema"] == report.SCHEMA
    assert set(report.ROW_KEYS) <= set(data["rows"][0])
    bad = dict(_row())
    del bad["busbw"]
    with pytest.raises(ValueError):
        report.write_json(str(p), {}, [bad])
    (tmp_path / "x.json").write_text("{}")
    with pytest.raises(ValueError):
        report.load_json(str(tmp_path / "x.json"))


# ------------------------------------------------------------------ optional dependencies

_WITHOUT = "import runpy, sys; sys.modules[{module!r}] = None; sys.argv = {argv!r}; "
_BENCH = ["pycomm.bench", "allreduce", "--nproc", "2"]


@pytest.mark.parametrize("module, fix, argv, runner", [
    ("matplotlib", "pip install matplotlib", _BENCH + ["--plot", "r.png"], "runpy.run_module"),
    ("matplotlib", "pip install matplotlib",
     [str(ROOT / "benchmarks" / "ddp" / "bench.py"), "--json", "r.json"], "runpy.run_path"),
    ("matplotlib", "pip install matplotlib",
     [str(ROOT / "benchmarks" / "pipeline" / "bench_pipeline.py"), "--out", "."], "runpy.run_path"),
    ("mpi4py", "pip install mpi4py mpich", _BENCH + ["--peers", "mpich", "--json", "r.json"],
     "runpy.run_module"),
    ("deepspeed", "pip install deepspeed", _BENCH + ["--peers", "deepspeed"], "runpy.run_module"),
], ids=["bench-plot", "ddp-bench", "pipeline-bench", "peer-mpich", "peer-deepspeed"])
def test_missing_module_fails_at_parsing(tmp_path, module, fix, argv, runner):
    """An option whose module is missing (a plot without matplotlib, a peer
    without its library) ends the command before anything runs, with one
    line naming the fix (a plot once crashed every rank after the sweep)."""
    code = _WITHOUT.format(module=module, argv=argv) + f"{runner}({argv[0]!r}, run_name='__main__')"
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 2, res.stdout + res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and module in lines[0] and fix in lines[0], lines
    assert res.stdout == "" and list(tmp_path.iterdir()) == []  # nothing ran, nothing written


# ------------------------------------------------------------------ end to end

def check_bound_rows(rows, sizes, bus_factor=1.0):
    """A run's bound rows (pycomm.bench.bounds): one copy-core and one
    copy-ranks row per size, unchecked, their traffic 2 x size per copy's
    time, their busbw the collective's at that time."""
    bounds = [r for r in rows if r.get("bound")]
    assert sorted((r["size"], r["algo"]) for r in bounds) == \
        [(s, b) for s in sorted(sizes) for b in ("copy-core", "copy-ranks")]
    for r in bounds:
        assert set(report.ROW_KEYS) <= set(r) and r["wrong"] is None and r["transport"] == "memory"
        assert math.isfinite(r["time_us"]) and r["time_us"] > 0
        assert r["traffic_GBps"] == pytest.approx(2 * r["size"] / r["time_us"] / 1e3)
        assert r["busbw"] == pytest.approx(r["size"] / r["time_us"] / 1e3 * bus_factor)


def test_bound_copy_moves_its_size_in_place():
    """The bound's copy: its buffer's bytes shift down by one cache line
    (size bytes read, size bytes written); an inactive copy does nothing."""
    from pycomm.bench.bounds import Copy, traffic_gbps

    for nbytes in (0, 1, 100, 4096):
        c = Copy(torch.device("cpu"), nbytes)
        buf = c._buf
        buf.copy_(torch.arange(buf.numel()) % 251)
        before = buf.clone()
        c()
        assert torch.equal(buf[:nbytes], before[64:64 + nbytes])
        assert torch.equal(buf[nbytes:], before[nbytes:])
    idle = Copy(torch.device("cpu"), 4096, active=False)
    assert idle.nbytes == 0 and idle._buf.numel() == 64
    assert traffic_gbps(1000, 1e-6) == pytest.approx(2.0) and traffic_gbps(1, 0.0) == 0.0


def _bench(args, tmp_path, timeout=240):
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "pycomm.bench", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_end_to_end_nproc2(tmp_path):
    res = _bench(["allreduce", "--nproc", "2", "-b", "64", "-e", "4K", "-f", "8", "-n", "2", "-w", "1",
                  "--algo", "ring,torch,nccl", "--json", "r.json", "--plot", "r.png"], tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    out = res.stdout
    assert "ring in-place" in out and "torch in-place" in out
    assert "# algo nccl: skipped" in out  # CPU: no nccl, said so, run goes on
    assert "# Out of bounds values : 0 OK" in out and "# Avg bus bandwidth" in out
    data = json.loads((tmp_path / "r.json").read_text())
    rows = [r for r in data["rows"] if not r.get("bound")]
    assert {r["algo"] for r in rows} == {"ring", "torch"}
    assert sorted({r["size"] for r in rows}) == [64, 512, 4096]
    check_bound_rows(data["rows"], [64, 512, 4096])
    for r in rows:
        assert set(report.ROW_KEYS) <= set(r)
        assert r["wrong"] == 0 and r["world_size"] == 2 and r["device"] == "cpu"
        assert r["busbw"] == pytest.approx(r["algbw"] * 1.0)
        assert math.isfinite(r["time_us"]) and r["time_us"] > 0
    assert "copy-core" in out and "copy-ranks" in out
    assert "# busbw / copy-ranks busbw at 4K (copy traffic " in out
    # the commit of the code measured (this checkout), "-dirty" if it has changes
    assert len(data["meta"]["commit"].split("-")[0]) == 40, data["meta"]["commit"]
    # the command as typed, launch flags included (a rank's argv lacks them)
    assert data["meta"]["command"].startswith("python -m pycomm.bench allreduce --nproc 2 -b 64 ")
    assert (tmp_path / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the model reads the file back
    m = _bench(["model", "r.json", "--worlds", "8", "--sizes", "1M"], tmp_path)
    assert m.returncode == 0, m.stderr
    assert "ring" in m.stdout and "torch" in m.stdout


def test_end_to_end_symmetric_series(tmp_path):
    """Algo "symmetric": all_reduce of a tensor registered before timing,
    checked like the others and reported beside them with its memcpy
    fraction; where it cannot run (another collective) it is skipped, said
    so."""
    res = _bench(["allreduce", "--nproc", "2", "-b", "4K", "-e", "1M", "-f", "16", "-n", "3",
                  "-w", "1", "--algo", "auto,symmetric,torch", "--json", "r.json"], tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "symmetric in-place" in res.stdout and "# Out of bounds values : 0 OK" in res.stdout
    assert "# busbw / copy-core busbw at 1M" in res.stdout and "symmetric" in \
        res.stdout.split("# busbw / copy-core")[1]
    rows = json.loads((tmp_path / "r.json").read_text())["rows"]
    sym = [r for r in rows if r["algo"] == "symmetric"]
    assert sorted(r["size"] for r in sym) == [4096, 65536, 1 << 20]
    assert all(r["wrong"] == 0 and r["transport"] == "shm" for r in sym)
    res = _bench(["reducescatter", "--nproc", "2", "-b", "4K", "-e", "4K", "-n", "2", "-w", "1",
                  "--algo", "ring,symmetric"], tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "# algo symmetric: skipped" in res.stdout


def test_wire_check_and_bytes():
    """The --wire series' check: a real int8 all-reduce (reference quantizer)
    passes within wire_atol and fails at the dtype's own tolerance; the bytes
    a rank sends, counted by hand."""
    from tests.test_quantized import _reference_all_reduce

    n, count = 3, 1000
    inputs = [C.rank_values(r, count).double() for r in range(n)]
    expected = torch.stack(inputs).sum(0)
    got = _reference_all_reduce([t.float() for t in inputs], "sum", C.WIRE_BLOCK)
    assert C.count_wrong(got, expected, C.wire_atol("int8", inputs, expected)) == 0
    assert C.count_wrong(got, expected) > 0  # the bound is what lets it pass
    assert C.count_wrong(got + 0.1 * expected.abs().max().float(), expected,
                         C.wire_atol("int8", inputs, expected)) == count
    for wire, fmt in (("fp8_e4m3", "float8_e4m3fn"), ("fp8_e5m2", "float8_e5m2")):
        got = _reference_all_reduce([t.float() for t in inputs], "sum", C.WIRE_BLOCK, fmt)
        assert C.count_wrong(got, expected, C.wire_atol(wire, inputs, expected)) == 0, wire
        assert C.count_wrong(got, expected) > 0, wire
    # 1000 elements = 4 blocks, 2 per chunk at 3 ranks (chunks of 512, 488, 0):
    # out 488 + 2 scales, then its 512 + 2 scales to 2 ranks
    assert C.sent_bytes("wire_int8", count, 4, n) == (488 + 8) + 2 * (512 + 8)
    assert C.sent_bytes("ring", 1024, 4, 4) == 2 * 3 * 256 * 4
    assert C.sent_bytes("tree", 1024, 4, 4) is None and C.sent_bytes("ring", 8, 4, 1) == 0
    assert cli.parse_args(["allreduce", "--wire", "int8", "-o", "avg"]).algo == [
        "ring", "torch", "wire_int8"]


def test_end_to_end_wire_series(tmp_path):
    res = _bench(["allreduce", "--nproc", "2", "-b", "4K", "-e", "1M", "-f", "16", "-n", "2",
                  "-w", "1", "--algo", "ring", "--wire", "int8", "--json", "r.json"], tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "wire_int8 in-place" in res.stdout and "# Out of bounds values : 0 OK" in res.stdout
    assert "# bytes sent per rank per call at 1M: ring 1.05 MB, wire_int8 0.266 MB (0.25x ring)" \
        in res.stdout, res.stdout
    rows = [r for r in json.loads((tmp_path / "r.json").read_text())["rows"]
            if r["algo"] == "wire_int8"]
    assert sorted(r["size"] for r in rows) == [4096, 65536, 1 << 20]
    assert all(r["wrong"] == 0 and r["sent_bytes"] > 0 for r in rows)


@pytest.mark.parametrize("coll", ["reduce", "gather", "scatter", "alltoall"])
def test_end_to_end_new_collectives_nproc2(tmp_path, coll):
    """pycomm and torch (gloo) side by side, root 1 for the rooted ones,
    every result checked (#wrong 0), busbw with nccl-tests' factor."""
    res = _bench([coll, "--nproc", "2", "-b", "8", "-e", "4K", "-f", "8", "-n", "2", "-w", "1",
                  "-r", "1", "--json", "r.json"], tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "# Out of bounds values : 0 OK" in res.stdout
    rows = [r for r in json.loads((tmp_path / "r.json").read_text())["rows"] if not r.get("bound")]
    assert {r["algo"] for r in rows} == {"ring", "torch"}
    factor = 1.0 if coll == "reduce" else 0.5
    for r in rows:
        assert r["wrong"] == 0 and r["collective"] == coll
        assert r["busbw"] == pytest.approx(r["algbw"] * factor)
        assert r["root"] == (-1 if coll == "alltoall" else 1)


def test_end_to_end_child_traceback_reaches_user(tmp_path):
    # -r 5 is not a rank of 2: every rank raises; the parent must print the
    # traceback and fail, not hang.
    res = _bench(["broadcast", "--nproc", "2", "-b", "64", "-e", "64", "-r", "5", "-T", "120"], tmp_path)
    assert res.returncode == 1
    assert "rank 0 failed" in res.stderr and "Traceback" in res.stderr
    assert "-r 5 is not a rank" in res.stderr


def test_memory_patterns_builds_and_prints_every_pattern(tmp_path):
    """benchmarks/allreduce/memory_patterns.c (the 2-rank all-reduce's memory
    patterns without pycomm, beside one core's memcpy) compiles and prints a
    row per pattern, in MiB and in KiB (then calls back to back per rep); a
    bad size is refused with its usage line."""
    src = Path(__file__).resolve().parents[1] / "benchmarks" / "allreduce" / "memory_patterns.c"
    exe = tmp_path / "memory_patterns"
    subprocess.run(["cc", "-O3", "-Wall", "-Werror", "-o", str(exe), str(src)], check=True,
                   timeout=120)
    for size, head in (("2", "# 2048 KiB per rank, 2 ranks, median of 2 reps of 1 calls"),
                       ("64K", "# 64 KiB per rank, 2 ranks, median of 2 reps of 16 calls")):
        out = subprocess.run([str(exe), size, "2"], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        lines = out.stdout.splitlines()
        assert lines[0].startswith(head), lines[0]
        assert [line.split()[0] for line in lines[2:]] == [
            "handshake", "memcpy_alone", "inplace_both", "symmetric", "staged", "staged_local",
            "cma_alone", "cma"]
    for bad in ("0", "6K", "2X"):
        res = subprocess.run([str(exe), bad], capture_output=True, text=True, timeout=60)
        assert res.returncode == 2 and "usage" in res.stderr, bad


def test_symmetric_bare_times_pycomm_beside_its_own_loop(tmp_path):
    """benchmarks/allreduce/symmetric_bare.py checks both sums, then times
    pycomm's symmetric all-reduce, the same loop bare and rank 0's memcpy in
    the same rounds; its JSON has every round of every series and a commit."""
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "allreduce" / "symmetric_bare.py"
    out = tmp_path / "bare.json"
    res = subprocess.run([sys.executable, str(script), "--mib", "1", "--rounds", "3", "--warmup",
                          "1", "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    rows = [line.split()[0] for line in res.stdout.splitlines() if not line.startswith("#")]
    assert rows == ["series", "pycomm", "bare", "memcpy"]
    assert "# pycomm / bare, per round (median): " in res.stdout
    data = json.loads(out.read_text())
    assert sorted(data["times_s"]) == ["bare", "memcpy", "pycomm"]
    assert all(len(v) == 3 and min(v) > 0 for v in data["times_s"].values())
    assert data["meta"]["commit"] and data["meta"]["mib"] == 1


def test_call_cost_times_a_world_of_one(tmp_path):
    """benchmarks/allreduce/call_cost.py times pycomm's world-of-one
    all-reduce beside torch's add_ (and mpi4py's Allreduce where installed)
    in the same rounds; its JSON has every round and a commit."""
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "allreduce" / "call_cost.py"
    out = tmp_path / "cost.json"
    res = subprocess.run([sys.executable, str(script), "--rounds", "2", "--calls", "200",
                          "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    data = json.loads(out.read_text())
    assert {"pycomm all_reduce", "torch add_"} <= set(data["us_per_call"])
    assert all(len(v) == 2 and min(v) > 0 for v in data["us_per_call"].values())
    assert data["commit"] and "pycomm all_reduce" in res.stdout


def test_gloo_loop_cpu_reports_time_and_cpu(tmp_path):
    """benchmarks/algorithms/gloo_loop_cpu.py: torch's gloo on 2 ranks, the
    time and the CPU (per thread) of a 1 KiB all-reduce, in its JSON."""
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "algorithms" / "gloo_loop_cpu.py"
    out = tmp_path / "cpu.json"
    res = subprocess.run([sys.executable, str(script), "--calls", "50", "--json", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [r["rank"] for r in rows] == [0, 1]
    assert all(r["us_per_call"] > 0 and r["cpu_us_per_call"] > 0 and r["cpu_us_per_call_by_thread"]
               for r in rows)
    assert res.stdout.count("us of CPU per call") == 2


def test_sent_bytes_between_hosts(monkeypatch):
    """On shm+gloo the count is what crosses hosts: this rank's 1/L of the
    tensor among the H hosts (2 x 2 here), by the ring ("auto") or quantized;
    "flat" is the gloo ring over all n ranks."""
    from types import SimpleNamespace

    from pycomm.bench import runner

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    s = SimpleNamespace(coll=C.SPECS["allreduce"], call=SimpleNamespace(world_size=4),
                        transport_of=lambda a: "gloo" if a == "flat" else "shm+gloo")
    count = 1 << 20
    assert runner._sent_bytes(s, "auto", count, 4 * count) == 2 * (count // 2 // 2) * 4
    assert runner._sent_bytes(s, "wire_int8", count, 4 * count) == \
        C.sent_bytes("wire_int8", count // 2, 4, 2)
    assert runner._sent_bytes(s, "flat", count, 4 * count) == 2 * 3 * (count // 4) * 4
    assert runner._sent_bytes(s, "torch", count, 4 * count) is None
