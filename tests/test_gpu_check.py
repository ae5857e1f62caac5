"""The GPU check without a GPU (issue 36): what scripts/gpu_check.sh runs is
imported and, where it takes any device, run here before a GPU comes.

* the dry run: ``--quick`` on a CPU machine ends at once with exit status 2,
  one line and a summary.json saying why;
* every Python file the check runs imports (the bench scripts, the driver,
  the world runner, the plan and its bodies), and tests/test_gpu.py and the
  plan use the same bodies;
* the world runner on gloo: a failing, a hanging and a dying case are
  recorded (traceback, stacks, signal) and the cases after them still run;
  the run's budget: a case running when it ends is hung, what cannot start
  is cut (not skipped);
* the device-generic bodies of the plan pass on gloo (2 ranks here, and the
  3-rank-only groups and NaN cases; all of 3 and 4 as ``slow``);
* the driver: its steps' time limits add up to its total, a step past its
  limit is killed with its children, a step that raises is recorded and the
  next one runs, anything cut for time makes the run incomplete (exit 1),
  SIGTERM kills the running step and saves a "killed" summary, pytest's and
  the worlds' results land in the summary, and the README paragraph renders
  from it.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest
import torch

from tests import gpu_cases, gpu_cases_layers
from tests.gpu_plan import CUDA_ONLY, PLANS, QUICK, REST
from tests.gpu_world import Case, CaseResult, run_world

ROOT = Path(__file__).resolve().parents[1]
NO_GPU = not torch.cuda.is_available()


def _load(path: str) -> ModuleType:
    """Imports a script of the checkout by path (syntax and imports checked)."""
    spec = importlib.util.spec_from_file_location(Path(path).stem + "_under_test", ROOT / path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def driver() -> ModuleType:
    return _load("scripts/gpu_check.py")


# ---------------------------------------------------------------- the dry run

@pytest.mark.skipif(not NO_GPU, reason="this machine has a GPU: the check would run")
def test_quick_without_a_gpu_exits_2_with_one_line(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(["bash", str(ROOT / "scripts/gpu_check.sh"), "--quick", str(out)],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHON": sys.executable})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu_check: no GPU: torch "), lines
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "no_gpu" and summary["reason"] in lines[0]
    assert summary["mode"] == "quick" and summary["torch"] == torch.__version__
    assert len(summary["commit"]) == 40 or summary["commit"] == "unknown"
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check.log", "summary.json"]


def test_usage_errors_exit_2(tmp_path):
    for args in ([], ["--fast", str(tmp_path)], ["--quick"], ["--all", str(tmp_path)]):
        proc = subprocess.run(["bash", str(ROOT / "scripts/gpu_check.sh"), *args],
                              capture_output=True, text=True, timeout=30)
        assert proc.returncode == 2 and "usage:" in proc.stderr, args


# ---------------------------------------------------------------- imports and coverage

def test_every_python_file_the_check_runs_imports(driver):
    kernel = _load("benchmarks/gpu/bench_kernel.py")
    allreduce = _load("benchmarks/gpu/bench_allreduce.py")
    assert callable(kernel.main) and callable(allreduce.main)
    assert set(driver.MODES) == {"quick", "rest"} and set(PLANS) == {"quick", "rest"}
    # tests/test_gpu.py skips at import without a GPU: compile it, and check
    # that what it takes from the bodies' modules exists.
    source = (ROOT / "tests/test_gpu.py").read_text()
    tree = ast.parse(source)
    compile(source, "tests/test_gpu.py", "exec")
    modules = {"cases": gpu_cases, "layers": gpu_cases_layers}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                and node.value.id in modules:
            assert hasattr(modules[node.value.id], node.attr), f"{node.value.id}.{node.attr}"
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("tests."):
            mod = importlib.import_module(node.module)
            for alias in node.names:
                assert hasattr(mod, alias.name), f"{node.module}.{alias.name}"


def _bodies_of_test_gpu() -> set[str]:
    """Names of the bodies tests/test_gpu.py passes to run_ranks."""
    tree = ast.parse((ROOT / "tests/test_gpu.py").read_text())
    return {call.args[1].attr for call in ast.walk(tree)
            if isinstance(call, ast.Call) and getattr(call.func, "id", "") == "run_ranks"
            and isinstance(call.args[1], ast.Attribute)}


def test_test_gpu_and_the_plans_run_the_same_bodies():
    planned = {case.fn.__name__ for plan in PLANS.values() for cases in plan.values()
               for case in cases}
    assert _bodies_of_test_gpu() == planned


def _worlds_of(fn: ast.FunctionDef, arg: ast.expr) -> list[int]:
    """The world sizes a test of tests/test_gpu.py passes as run_ranks' first
    argument: a number, or its ``world`` parameter (from its parametrize)."""
    if isinstance(arg, ast.Constant):
        assert isinstance(arg.value, int), arg.value
        return [arg.value]
    assert isinstance(arg, ast.Name), ast.dump(arg)
    for deco in fn.decorator_list:
        if isinstance(deco, ast.Call) and isinstance(deco.args[0], ast.Constant):
            names = [n.strip() for n in str(deco.args[0].value).split(",")]
            if arg.id in names:
                values = ast.literal_eval(deco.args[1])
                k = names.index(arg.id)
                return [v[k] if len(names) > 1 else v for v in values]
    raise AssertionError(f"{fn.name}: no parametrize for {arg.id}")


def test_the_plans_run_each_body_at_every_world_size_test_gpu_does():
    tree = ast.parse((ROOT / "tests/test_gpu.py").read_text())
    wanted: set[tuple[str, int]] = set()
    for fn in ast.walk(tree):
        if isinstance(fn, ast.FunctionDef) and fn.name.startswith("test_"):
            for call in ast.walk(fn):
                if isinstance(call, ast.Call) and getattr(call.func, "id", "") == "run_ranks":
                    body = call.args[1]
                    assert isinstance(body, ast.Attribute), ast.dump(body)
                    wanted |= {(body.attr, w) for w in _worlds_of(fn, call.args[0])}
    planned = {(case.fn.__name__, size) for plan in PLANS.values()
               for size, cases in plan.items() for case in cases}
    assert len(wanted) > 20 and wanted <= planned, sorted(wanted - planned)


def test_plans_are_well_formed():
    import pickle

    for plan in PLANS.values():
        for size, cases in plan.items():
            names = [c.name for c in cases]
            assert len(set(names)) == len(names), (size, names)
            # the case that aborts its communicator on purpose comes last
            aborting = [i for i, c in enumerate(cases) if c.close_may_fail]
            assert aborting in ([], [len(cases) - 1]), (size, names)
            for c in cases:
                assert pickle.loads(pickle.dumps(c)).fn is c.fn  # travels to the ranks
                assert c.fn.__module__ in ("tests.gpu_cases", "tests.gpu_cases_layers")


# ---------------------------------------------------------------- the runner on gloo

def _passes(comm, store):
    t = torch.ones(8)
    comm.all_reduce(t)
    assert torch.all(t == comm.world_size)


def _fails_on_rank_1(comm, store):
    if comm.rank == 1:
        raise AssertionError("failing on purpose")


def _hangs_on_rank_0(comm, store):
    while comm.rank == 0:
        time.sleep(0.05)


def _dies_on_rank_1(comm, store):
    if comm.rank == 1:
        os.kill(os.getpid(), signal.SIGSEGV)
    comm.barrier()  # rank 0 waits for the dead rank


def _skips(comm, store):
    pytest.skip("not on this machine")


def _sleeps(comm, store, seconds):
    time.sleep(seconds)


def _statuses(results: list[CaseResult]) -> list[str]:
    return [r.status for r in results]


def test_world_runner_records_failures_hangs_and_deaths_and_goes_on():
    cases = [Case("ok", _passes), Case("fails", _fails_on_rank_1), Case("ok_after_failure", _passes),
             Case("hangs", _hangs_on_rank_0, deadline_s=4), Case("ok_after_hang", _passes),
             Case("dies", _dies_on_rank_1), Case("ok_after_death", _passes), Case("skips", _skips),
             Case("two_gpus", _passes, min_gpus=2)]
    seen: list[str] = []
    start = time.monotonic()
    res = run_world(2, cases, transport="gloo", device="cpu", comm_timeout=30,
                    on_result=lambda r: seen.append(r.name))
    assert _statuses(res) == ["passed", "failed", "passed", "hung", "passed", "died", "passed",
                              "skipped", "skipped"], [(r.name, r.status, r.detail) for r in res]
    fails, hangs, dies = res[1], res[3], res[5]
    assert "--- rank 1 ---" in fails.detail and "failing on purpose" in fails.detail
    assert fails.ranks == {0: "passed", 1: "failed"}
    assert "ranks [0] did not finish" in hangs.detail and "_hangs_on_rank_0" in hangs.detail
    assert hangs.ranks == {0: "running", 1: "passed"} and hangs.seconds >= 4
    assert "rank 1 killed by SIGSEGV" in dies.detail
    assert res[7].detail == "not on this machine" and "needs 2 GPUs" in res[8].detail
    assert sorted(seen) == sorted(c.name for c in cases)  # reported as they came
    assert time.monotonic() - start < 90


def test_world_runner_cuts_what_the_budget_leaves_no_time_for():
    # a case still running when the budget ends is hung (with its stacks),
    # even with a deadline past the budget; what cannot start is cut, not skipped
    cases = [Case("sleeps", _sleeps, {"seconds": 60}, deadline_s=120), Case("after", _passes),
             Case("two_gpus", _passes, min_gpus=2)]
    start = time.monotonic()
    res = run_world(2, cases, transport="gloo", device="cpu", budget_s=12)
    took = time.monotonic() - start
    assert _statuses(res) == ["hung", "cut", "skipped"], [(r.name, r.detail) for r in res]
    assert "still running when the run's time ran out" in res[0].detail
    assert "_sleeps" in res[0].detail and res[0].ranks == {0: "running", 1: "running"}
    assert "not started" in res[1].detail and "needs 2 GPUs" in res[2].detail
    assert 12 <= took < 30


def _cpu_cases(sizes: list[dict[int, list[Case]]], size: int) -> list[Case]:
    """The plans' cases of world ``size`` that take any device, once each."""
    out: dict[str, Case] = {}
    for plan in sizes:
        for c in plan.get(size, []):
            if c.fn not in CUDA_ONLY:
                out.setdefault(c.name, c)
    return list(out.values())


def _group(case: Case) -> str:
    """Splits the 2-rank run into tests of under 30 s each."""
    if case.fn.__module__ == gpu_cases_layers.__name__:
        return "layers"
    if case.fn in (gpu_cases.argument_errors, gpu_cases.checked_mode, gpu_cases.timeout_aborts):
        return "errors"
    if case.fn in (gpu_cases.all_reduce_sweep, gpu_cases.default_slices_and_auto,
                   gpu_cases.nan_propagation, gpu_cases.wire_matches_cpu):
        return "all_reduce"
    return "collectives"


def _run_on_gloo(size: int, cases: list[Case]) -> None:
    assert cases
    res = run_world(size, cases, transport="gloo", device="cpu", comm_timeout=60)
    bad = [f"{r.name}: {r.status}\n{r.detail}" for r in res if r.status != "passed"]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("group", ["all_reduce", "collectives", "errors", "layers"])
def test_plan_bodies_pass_on_gloo_2_ranks(group):
    _run_on_gloo(2, [c for c in _cpu_cases([QUICK, REST], 2) if _group(c) == group])


def test_three_rank_only_bodies_pass_on_gloo():
    # groups (new_group / split) and the NaN propagation run at 3 ranks only;
    # the classic algorithms at 3 and 4 (the fold: 3)
    cases = [c for c in _cpu_cases([QUICK, REST], 3)
             if c.fn in (gpu_cases.groups, gpu_cases.nan_propagation, gpu_cases.classic_algorithms)]
    assert len(cases) == 3
    _run_on_gloo(3, cases)


@pytest.mark.slow
@pytest.mark.parametrize("size", [3, 4])
def test_plan_bodies_pass_on_gloo(size):
    _run_on_gloo(size, _cpu_cases([QUICK, REST], size))


# ---------------------------------------------------------------- the driver

@pytest.mark.parametrize("total", [465.0, 240.0])
def test_step_limits_fit_the_total_whatever_each_step_takes(driver, total):
    for mode, steps in driver.MODES.items():
        for build_s in (20.0, 200.0, 1000.0):  # the build takes this (at most its limit) ...
            left, used, ran = total, [], []
            for i, step in enumerate(steps):
                limit = driver.step_limit(step, steps[i + 1:], left)
                if limit < max(step.min_s, 1.0):  # skipped, as run_steps does
                    continue
                # ... and every other step all it may
                took = min(limit, build_s) if step.name == "build" else limit
                left -= took
                used.append(took)
                ran.append(step.name)
            assert sum(used) <= total - driver.RESERVE_S, (mode, total, build_s, used)
            # the steps that go without are the last ones
            assert ran == [s.name for s in steps[:len(ran)]], (mode, total, build_s, ran)
            if total == 465 or build_s == 20:
                assert len(ran) >= len(steps) - 1, (mode, total, build_s, ran)


def _gone(pid: int, limit_s: float = 5.0) -> bool:
    """Whether process ``pid`` is gone within ``limit_s`` (a killed orphan is
    reaped by init shortly after)."""
    deadline = time.monotonic() + limit_s
    while Path(f"/proc/{pid}").exists():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_a_step_past_its_limit_is_killed_with_its_children(driver, tmp_path):
    run = driver.Run("quick", tmp_path, 100, tmp=tmp_path)
    pid_file = tmp_path / "child.pid"
    start = time.monotonic()
    rc, tail = run.execute("sleepy", ["bash", "-c", f"sleep 100 & echo $! > {pid_file}; wait"], 1.0)
    assert rc is None and time.monotonic() - start < 20
    assert "ran past its 1 s and was killed" in (tmp_path / "sleepy.log").read_text()
    assert _gone(int(pid_file.read_text())), "the step's child outlived it"


def test_extension_step_says_when_the_build_has_no_cuda(driver, tmp_path):
    from pycomm._ext import _C

    run = driver.Run("quick", tmp_path, 100, tmp=tmp_path)
    ok = driver.step_extension(run, 60)
    assert ok == bool(_C.WITH_CUDA)
    if not ok:
        (failure,) = run.summary["tests"]["failures"]
        assert "pycomm._C was built without CUDA" in failure["traceback"], failure
    assert (tmp_path / "build.log").exists()


def test_kernel_step_records_pytest_results(driver, tmp_path):
    run = driver.Run("quick", tmp_path, 100, tmp=tmp_path)
    ok = driver.pytest_step(run, "kernels", 60, driver.KERNEL_TESTS)
    t = run.summary["tests"]
    assert (tmp_path / "kernels.log").exists()
    if NO_GPU:  # tests/test_gpu.py skips as a whole: nothing passed, so the step fails
        assert not ok and t["passed"] == 0 and t["skipped"] >= 1, t
        (failure,) = t["failures"]
        assert failure["name"] == "kernels" and "no test passed" in failure["traceback"]


def test_kernel_tests_exist_in_test_gpu(driver):
    tree = ast.parse((ROOT / "tests/test_gpu.py").read_text())
    tests = {f.name for f in ast.walk(tree) if isinstance(f, ast.FunctionDef)}
    names = [n.strip() for n in driver.KERNEL_TESTS.split(" or ")]
    assert names and set(names) <= tests, set(names) - tests


def _fake_step(driver, name, fn, min_s=0.0):
    return driver.Step(name, fn, cap_s=30, min_s=min_s)


def test_anything_cut_for_time_makes_the_run_incomplete(driver, tmp_path):
    def cuts_a_case(run, limit):
        run.test("world2/slow", "cut", "not started: the run's time ran out", "world2")
        return True

    def declines(run, limit):
        run.test("world2/two_gpus", "skipped", "needs 2 GPUs")
        return True

    run = driver.Run("quick", tmp_path, 2000, tmp=tmp_path)  # c needs 1000 s, gets its cap of 30
    driver.run_steps(run, [_fake_step(driver, "a", declines), _fake_step(driver, "b", cuts_a_case),
                           _fake_step(driver, "c", declines, min_s=1000)])
    assert [s["status"] for s in run.summary["steps"]] == ["passed", "incomplete", "cut"]
    assert driver.finish(run) == 1
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "incomplete"
    t = summary["tests"]
    assert (t["passed"], t["failed"], t["skipped"], t["cut"]) == (0, 0, 1, 2), t
    assert [c["name"] for c in t["cuts"]] == ["world2/slow", "c"]
    # a min_gpus skip alone is no cut: passed, exit 0
    run = driver.Run("quick", tmp_path, 100, tmp=tmp_path)
    driver.run_steps(run, [_fake_step(driver, "a", declines)])
    assert driver.finish(run) == 0 and run.summary["status"] == "passed"


def test_a_step_that_raises_is_recorded_and_the_next_runs(driver, tmp_path):
    def raises(run, limit):
        raise ValueError("bad JSON on purpose")

    def passes(run, limit):
        run.test("after", "passed")
        return True

    run = driver.Run("quick", tmp_path, 100, tmp=tmp_path)
    driver.run_steps(run, [_fake_step(driver, "boom", raises), _fake_step(driver, "next", passes)])
    assert [s["status"] for s in run.summary["steps"]] == ["failed", "passed"]
    (failure,) = run.summary["tests"]["failures"]
    assert failure["name"] == failure["step"] == "boom"
    assert "ValueError: bad JSON on purpose" in failure["traceback"]
    assert driver.finish(run) == 1 and run.summary["tests"]["passed"] == 1


_SIGTERM_RUN = """
import signal, sys
sys.path.insert(0, {root!r})
import importlib.util
spec = importlib.util.spec_from_file_location("gpu_check_sig", {driver!r})
d = importlib.util.module_from_spec(spec); sys.modules[spec.name] = d; spec.loader.exec_module(d)
from pathlib import Path
out = Path({out!r})
run = d.Run("quick", out, 100, tmp=out)
signal.signal(signal.SIGTERM, d._on_signal(run))
def sleepy(run, limit):
    run.execute("sleepy", ["bash", "-c", "sleep 100 & echo $! > " + str(out / "child.pid") + "; wait"], 60)
    return True
try:
    d.run_steps(run, [d.Step("sleepy", sleepy, cap_s=60)])
except d.Killed:
    sys.exit(1)
"""


def test_sigterm_kills_the_running_step_and_saves_a_killed_summary(tmp_path):
    code = _SIGTERM_RUN.format(root=str(ROOT), driver=str(ROOT / "scripts/gpu_check.py"),
                               out=str(tmp_path))
    proc = subprocess.Popen([sys.executable, "-c", code])
    pid_file = tmp_path / "child.pid"
    for _ in range(300):
        if pid_file.exists() and pid_file.read_text().strip():
            break
        time.sleep(0.05)
    child = int(pid_file.read_text())
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 1
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "killed" and "SIGTERM" in summary["reason"]
    assert summary["steps"] == [{"name": "sleepy", "status": "killed"}]
    assert summary["tests"]["failures"][0]["status"] == "killed"
    # the step ran in a session of its own: killed all the same
    assert _gone(child), "the step's child outlived the driver"


def test_world_step_records_each_case(driver, tmp_path):
    run = driver.Run("quick", tmp_path, 100, tmp=tmp_path)
    run.summary["gpus"] = 0
    run.transport, run.device, run.only = "gloo", "cpu", "argument_errors,checked_mode"
    assert driver.world_step(2)(run, 90)
    t = run.summary["tests"]
    assert (t["passed"], t["failed"]) == (2, 0), t
    log = (tmp_path / "world2.log").read_text()
    assert "world2/argument_errors: passed" in log and "world2/checked_mode: passed" in log


def test_junit_parsing(driver, tmp_path):
    xml = tmp_path / "r.xml"
    xml.write_text(
        '<testsuites><testsuite><testcase classname="tests.test_gpu" name="test_a"/>'
        '<testcase classname="tests.test_gpu" name="test_b"><failure message="boom">trace'
        '</failure></testcase><testcase classname="tests.test_gpu" name="test_c">'
        '<skipped message="no avg"/></testcase></testsuite></testsuites>')
    assert driver.parse_junit(xml) == [("tests.test_gpu::test_a", "passed", ""),
                                       ("tests.test_gpu::test_b", "failed", "boom\ntrace"),
                                       ("tests.test_gpu::test_c", "skipped", "no avg")]


def test_render_the_readme_paragraph(driver):
    summary = {
        "mode": "quick", "commit": "0123456789abcdef" * 2 + "01234567", "date": "2026-11-26T10:00:00",
        "device": "NVIDIA H100 80GB HBM3", "torch": "2.11.0+cu130", "nccl": "2.28.9",
        "python": "3.12.3", "wall_s": 431.2, "status": "failed",
        "tests": {"passed": 80, "failed": 1, "skipped": 2, "skips": [],
                  "failures": [{"name": "world2/timeout_aborts_and_raises", "status": "hung",
                                "traceback": "hung: ranks [0] did not finish\n--- rank 0 stack ---"}]},
        "benchmarks": {"kernel": {"goal": {"met": False}, "rows": [
            {"dtype": "float32", "reduce_GBps": 2900.1, "reduce_over_torch_add": 1.01},
            {"dtype": "bfloat16", "reduce_GBps": 2800.0, "reduce_over_torch_add": 0.97}]}},
    }
    text = driver.render([summary, {"mode": "rest", "status": "no_gpu", "date": "2026-11-26",
                                    "reason": "no GPU", "tests": {}}])
    assert "`scripts/gpu_check.sh --quick` on 2026-11-26, commit `0123456789ab`" in text
    assert "80 passed, 1 failed, 2 skipped in 431 s" in text
    assert "`world2/timeout_aborts_and_raises` (hung): hung: ranks [0] did not finish" in text
    assert "float32 2900.1 GB/s = 1.01x" in text and "not met" in text
    assert "`--rest` on 2026-11-26: not run (no GPU)" in text
