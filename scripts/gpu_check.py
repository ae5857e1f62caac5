#!/usr/bin/env python3
"""The GPU check's driver: timed steps, every failure recorded, summary.json.

    python3 scripts/gpu_check.py run --mode quick|rest --out OUTDIR [--total 465]
    python3 scripts/gpu_check.py render SUMMARY.json [SUMMARY.json ...]

``scripts/gpu_check.sh`` is the entry point (its header says what each mode
covers); ``run`` does the work. Steps run one after the other, each as a
subprocess under a time limit, in its own process group (a timeout kills
its ranks too), logging to OUTDIR/<step>.log:

    quick: build, extension, kernels (pytest), bench_kernel, world2, world3
    rest:  build, extension, world2, world3, world4, bench_allreduce

Time: ``--total`` seconds for the whole run. A step's limit is its cap, and
never more than the time left minus the minimum that every later step is
promised; the worlds' steps take a share of what is left (world2 of quick:
65 %, it has the most cases, and world3 keeps the rest). With too little
time for every step's minimum the last steps are *cut* (not run for lack of
time; a step whose cases the budget cut is *incomplete*): the run is then
``incomplete``, exit status 1, never "passed". A step that fails, or whose
code raises (recorded as a failure of that step), does not stop the run,
except the build and the extension check (nothing else can run); a build
killed at its limit is recorded as ``timeout``. summary.json is rewritten
(atomically) after every step; SIGTERM or SIGINT (the outer ``timeout``)
kills the running step's process group and saves it with status "killed".

``render`` prints the README's GPU paragraph from summaries (what ran,
where, at which commit, what failed, the kernel's speed).

Exit status of ``run``: 0 all passed; 1 something failed, was cut for time
or the run was killed; 2 no GPU here, or no ninja (one line says why;
summary.json says it too).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

ROOT = Path(__file__).resolve().parents[1]
RESERVE_S = 10.0  # kept for writing the summary after the last step
MAX_TRACEBACK = 20_000  # characters of one failure's traceback in the summary
KERNEL_TESTS = (
    "test_kernel_bitwise_equals_cpu or test_scale_and_fused_reduce_scale_bitwise"
    " or test_quantize_kernels_bitwise_equal_cpu"
)


class NoGPU(Exception):
    """This machine cannot run the GPU check (the message says why)."""

    status, label = "no_gpu", "no GPU"


class NoNinja(NoGPU):
    """A GPU, but no ninja: the build would be serial and miss its time."""

    status, label = "no_ninja", "no ninja"


class Killed(BaseException):
    """The driver got SIGTERM or SIGINT (not an Exception: no step catches it)."""


# ------------------------------------------------------------------ the run

@dataclass(frozen=True)
class Step:
    """One step: ``fn(run, limit_s)`` records its own outcome.

    Attributes:
        cap_s: the most it may take. share: of the time left (after what
        later steps are promised). min_s: promised to it by earlier steps;
        cut with less. fatal: a failure ends the run.
    """

    name: str
    fn: Callable[["Run", float], bool]
    cap_s: float
    min_s: float = 0.0
    share: float = 1.0
    fatal: bool = False


class Run:
    """One run of the check: its output folder, clock and summary."""

    def __init__(self, mode: str, out: Path, total_s: float, tmp: Path | None = None) -> None:
        self.mode, self.out, self.total_s = mode, out, total_s
        self.start = time.monotonic()
        # Steps' result files that the summary takes in: outside OUTDIR, whose
        # files are what comes back from a device machine (at most 8).
        self.tmp = tmp or Path(tempfile.mkdtemp(prefix="gpu_check-"))
        self._own_tmp = tmp is None
        self.py = sys.executable
        # Where the worlds' ranks run, and which cases (all when empty): the
        # CPU tests point a run at gloo and a few device-generic cases.
        self.transport, self.device, self.only = "nccl", "cuda:0", ""
        self.current: subprocess.Popen | None = None  # the step's process running now
        self.summary: dict[str, Any] = {
            "mode": mode, "commit": commit(), "status": "running",
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "python": platform.python_version(), "wall_s": 0.0, "steps": [],
            "tests": {"passed": 0, "failed": 0, "skipped": 0, "cut": 0, "failures": [],
                      "skips": [], "cuts": []},
            "benchmarks": {},
        }

    def close(self) -> None:
        """Removes the run's own temporary folder."""
        if self._own_tmp:
            shutil.rmtree(self.tmp, ignore_errors=True)

    def left(self) -> float:
        return self.total_s - (time.monotonic() - self.start)

    def save(self) -> None:
        """Writes summary.json atomically (a reader never sees half of it)."""
        self.summary["wall_s"] = round(time.monotonic() - self.start, 1)
        path = self.out / "summary.json"
        tmp = path.with_name(f".summary.json.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(self.summary, indent=1) + "\n")
        os.replace(tmp, path)

    def log(self, msg: str) -> None:
        print(f"gpu_check: {msg}", flush=True)

    def test(self, name: str, status: str, detail: str = "", step: str = "") -> None:
        """Counts one test: passed; skipped (declined by the test); cut (not
        run for lack of time); else a failure (failed, hung, died, timeout, killed)."""
        t = self.summary["tests"]
        if status == "passed":
            t["passed"] += 1
        elif status == "skipped":
            t["skipped"] += 1
            t["skips"].append({"name": name, "reason": detail[:500]})
        elif status == "cut":
            t["cut"] += 1
            t["cuts"].append({"name": name, "step": step, "reason": detail[:500]})
        else:
            t["failed"] += 1
            t["failures"].append({"name": name, "step": step, "status": status,
                                  "traceback": _clip(detail)})

    def execute(self, step: str, argv: Sequence[str], limit: float,
                env: dict[str, str] | None = None, log_name: str = "") -> tuple[int | None, str]:
        """Runs ``argv`` in its own process group under ``limit`` seconds,
        output to OUTDIR/<step>.log (or appended to OUTDIR/<log_name>.log).
        Returns (exit status or None on timeout, the tail of its output)."""
        log_path = self.out / f"{log_name or step}.log"
        start = log_path.stat().st_size if log_name and log_path.exists() else 0
        with open(log_path, "a" if log_name else "w") as log:
            log.write(f"$ {' '.join(argv)}\n")
            log.flush()
            proc = subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                    env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
                                    start_new_session=True)
            self.current = proc  # for the signal handler: kill its group too
            try:
                rc: int | None = proc.wait(timeout=max(limit, 1.0))
            except subprocess.TimeoutExpired:
                rc = None
                _kill_group(proc)
                log.write(f"\ngpu_check: step {step} ran past its {limit:.0f} s and was killed\n")
            finally:
                self.current = None
        return rc, _tail(log_path, start)


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL, to the process group of ``proc`` (its ranks too)."""
    for sig, wait in ((signal.SIGTERM, 5), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _tail(path: Path, start: int = 0, lines: int = 60) -> str:
    """The last ``lines`` lines of ``path`` from byte ``start`` on."""
    with open(path, "rb") as f:
        f.seek(start)
        text = f.read().decode(errors="replace")
    return "\n".join(text.splitlines()[-lines:])


def _clip(text: str) -> str:
    if len(text) <= MAX_TRACEBACK:
        return text
    half = MAX_TRACEBACK // 2
    return f"{text[:half]}\n[... {len(text) - MAX_TRACEBACK} characters cut ...]\n{text[-half:]}"


def commit() -> str:
    """GPU_CHECK_COMMIT, else the checkout's HEAD, else "unknown" (the GPU
    machine's copy of the tree may come without .git: pass the sha)."""
    if os.environ.get("GPU_CHECK_COMMIT"):
        return os.environ["GPU_CHECK_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 else "unknown"


# ------------------------------------------------------------------ steps

def probe_gpu(info: dict[str, Any]) -> None:
    """Adds torch, CUDA, ninja, NCCL and this machine's GPU to ``info``;
    NoGPU if there is none, NoNinja without ninja (``info`` then says what
    there is)."""
    try:
        import torch
    except Exception as e:  # noqa: BLE001
        raise NoGPU(f"cannot import torch ({e}); install a CUDA build of torch") from e
    from torch.utils.cpp_extension import is_ninja_available

    info.update(torch=torch.__version__, cuda=torch.version.cuda, ninja=bool(is_ninja_available()))
    if torch.version.cuda is None:
        raise NoGPU(f"torch {torch.__version__} is a CPU build (torch.version.cuda is None), "
                    "so no GPU can be used here; run it on a machine with an NVIDIA GPU "
                    "and a CUDA build of torch")
    if not torch.cuda.is_available():
        raise NoGPU(f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU "
                    "(torch.cuda.is_available() is False); run it on a machine with an NVIDIA GPU")
    v = torch.cuda.nccl.version()
    info["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    info["gpus"] = torch.cuda.device_count()
    info["device"] = torch.cuda.get_device_name(0)
    major, minor = torch.cuda.get_device_capability(0)
    info["arch"] = f"{major}.{minor}"
    if not info["ninja"]:
        raise NoNinja("ninja is not available (torch.utils.cpp_extension.is_ninja_available() "
                      "is False): the build needs ninja's parallel jobs to fit its time; "
                      "pip install ninja")


def step_build(run: Run, limit: float) -> bool:
    """The CUDA extension in place, through ninja, for this GPU's arch only."""
    env = {"TORCH_CUDA_ARCH_LIST": os.environ.get("TORCH_CUDA_ARCH_LIST") or run.summary["arch"],
           "MAX_JOBS": os.environ.get("MAX_JOBS") or str(os.cpu_count() or 1)}
    run.log(f"build: TORCH_CUDA_ARCH_LIST={env['TORCH_CUDA_ARCH_LIST']} MAX_JOBS={env['MAX_JOBS']}")
    rc, tail = run.execute("build", [run.py, "setup.py", "build_ext", "--inplace"], limit, env)
    if rc is None:
        run.test("build", "timeout", f"the build ran past its {limit:.0f} s and was killed\n{tail}",
                 "build")
    elif rc != 0:
        run.test("build", "failed", tail, "build")
    return rc == 0


# argv[1]: where to write what it found (JSON): not the log, whose last line
# may be any warning printed at exit.
_EXTENSION_PROBE = """
import json, pathlib, sys
import torch
if not list(pathlib.Path("pycomm").glob("_C*.so")):
    sys.exit("no pycomm/_C*.so: the build produced no extension")
from pycomm._ext import _C
if not getattr(_C, "WITH_CUDA", False):
    sys.exit("pycomm._C was built without CUDA (see build.log, lines 'pycomm:')")
import pycomm
pathlib.Path(sys.argv[1]).write_text(json.dumps({
    "with_cuda": True, "nccl_headers": int(getattr(_C, "NCCL_VERSION", 0)),
    "pycomm": getattr(pycomm, "__version__", "?")}))
"""


def step_extension(run: Run, limit: float) -> bool:
    """``import pycomm`` with ``pycomm._C.WITH_CUDA`` (never JIT-compiles)."""
    found = run.tmp / "extension.json"
    found.unlink(missing_ok=True)
    rc, tail = run.execute("extension", [run.py, "-c", _EXTENSION_PROBE, str(found)], limit,
                           log_name="build")
    if rc != 0 or not found.exists():
        run.test("import pycomm (WITH_CUDA)", "failed" if rc is not None else "hung", tail, "extension")
        return False
    info = json.loads(found.read_text())
    code = info["nccl_headers"]
    run.summary["nccl_headers"] = f"{code // 10000}.{code // 100 % 100}.{code % 100}"
    run.test("import pycomm (WITH_CUDA)", "passed")
    return True


def parse_junit(path: Path) -> list[tuple[str, str, str]]:
    """(name, status, detail) of every test in a pytest JUnit XML file
    (ET.ParseError when it is not whole: pytest killed while writing it)."""
    out = []
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        status, detail = "passed", ""
        for child in case:
            if child.tag in ("failure", "error"):
                status = "failed"
                detail = f"{child.get('message', '')}\n{child.text or ''}".strip()
            elif child.tag == "skipped":
                status, detail = "skipped", child.get("message", "")
        out.append((name, status, detail))
    return out


def pytest_step(run: Run, step: str, limit: float, select: str) -> bool:
    """tests/test_gpu.py -k ``select``, each test a record of the summary;
    passes only when at least one test passed and none failed (a selection
    that matches nothing, or all skipped, fails)."""
    xml = run.tmp / f"{step}.xml"
    argv = [run.py, "-m", "pytest", "tests/test_gpu.py", "-m", "gpu", "-k", select, "-q", "-rs",
            "-p", "no:cacheprovider", f"--junitxml={xml}"]
    per_test = max(limit - 15, 10)
    argv += [f"--timeout={per_test:.0f}"] if _has("pytest_timeout") else []
    rc, tail = run.execute(step, argv, limit)
    if not xml.exists():
        run.test(step, "failed" if rc is not None else "hung", tail, step)
        return False
    try:
        records = parse_junit(xml)
    except ET.ParseError as e:
        run.test(step, "failed" if rc is not None else "hung",
                 f"pytest's JUnit XML is not whole ({e})\n{tail}", step)
        return False
    for name, status, detail in records:
        run.test(name, status, detail, step)
    if rc is None:
        run.test(step, "hung", f"pytest ran past {limit:.0f} s\n{tail}", step)
        return False
    if not any(status == "passed" for _, status, _ in records):
        run.test(step, "failed", f"no test passed (pytest status {rc}: nothing selected by "
                 f"-k {select!r}, or all skipped)\n{tail}", step)
        return False
    return rc == 0


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def step_kernels(run: Run, limit: float) -> bool:
    """The reduction kernels against the CPU, bitwise (one process)."""
    return pytest_step(run, "kernels", limit, KERNEL_TESTS)


def world_step(size: int) -> Callable[[Run, float], bool]:
    """The step that runs world ``size`` of the run's plan (tests/gpu_world.py)."""

    def step(run: Run, limit: float) -> bool:
        name = f"world{size}"
        out = run.tmp / f"{name}.json"
        argv = [run.py, "-m", "tests.gpu_world", "--plan", run.mode, "--size", str(size),
                "--json", str(out), "--budget", f"{max(limit - 10, 5):.0f}",
                "--gpus", str(run.summary["gpus"]), "--transport", run.transport,
                "--device", run.device] + (["--cases", run.only] if run.only else [])
        rc, tail = run.execute(name, argv, limit)
        try:
            results = json.loads(out.read_text()) if out.exists() else []
        except ValueError as e:  # written atomically: should not happen
            run.test(name, "failed", f"unreadable results {out} ({e})\n{tail}", name)
            return False
        for res in results:
            run.test(f"{name}/{res['name']}", res["status"], res["detail"], name)
        if rc != 0 and not any(r["status"] in ("failed", "hung", "died") for r in results):
            run.test(name, "failed" if rc is not None else "hung",
                     f"the world runner ended with status {rc}:\n{tail}", name)
        return rc == 0

    step.__name__ = f"world{size}"
    return step


def step_bench_kernel(run: Run, limit: float) -> bool:
    """Reduction kernel vs torch add_ and a copy, 256 MiB fp32/bf16/fp16."""
    out = run.tmp / "kernel.json"
    rc, tail = run.execute("bench_kernel", [run.py, "benchmarks/gpu/bench_kernel.py", "--out",
                                            str(out)], limit)
    if rc != 0 or not out.exists():
        run.test("bench_kernel", "failed" if rc is not None else "hung", tail, "bench_kernel")
        return False
    data = json.loads(out.read_text())
    data["goal"] = {"reduce_over_torch_add": 1.0,
                    "met": all(r["reduce_over_torch_add"] >= 1.0 for r in data["rows"])}
    run.summary["benchmarks"]["kernel"] = data
    return True


def step_bench_allreduce(run: Run, limit: float) -> bool:
    """Ring vs NCCL vs auto all-reduce, 2 ranks sharing the GPU (works, not speed)."""
    out, table = run.tmp / "allreduce.json", run.tmp / "auto_table.json"
    argv = [run.py, "benchmarks/gpu/bench_allreduce.py", "--out", str(out), "--auto-table", str(table),
            "--sizes", "64", "256", "1024"]
    rc, tail = run.execute("bench_allreduce", argv, limit)
    if rc != 0 or not out.exists():
        run.test("bench_allreduce", "failed" if rc is not None else "hung", tail, "bench_allreduce")
        return False
    data = json.loads(out.read_text())
    data["auto_table"] = json.loads(table.read_text()) if table.exists() else None
    run.summary["benchmarks"]["allreduce"] = data
    return True


MODES: dict[str, list[Step]] = {
    "quick": [
        Step("build", step_build, cap_s=300, min_s=30, fatal=True),
        Step("extension", step_extension, cap_s=45, min_s=20, fatal=True),
        Step("kernels", step_kernels, cap_s=75, min_s=30),
        Step("bench_kernel", step_bench_kernel, cap_s=45, min_s=20),
        Step("world2", world_step(2), cap_s=400, min_s=60, share=0.65),
        Step("world3", world_step(3), cap_s=400, min_s=60),
    ],
    "rest": [
        Step("build", step_build, cap_s=300, min_s=30, fatal=True),
        Step("extension", step_extension, cap_s=45, min_s=20, fatal=True),
        # world4 last of the worlds, with what the others leave: its cases take
        # the longest (four ranks on one GPU); first, with a fixed share, it was
        # cut short while much of the run went unused (benchmarks/results/gpu).
        Step("world2", world_step(2), cap_s=400, min_s=60, share=0.25),
        Step("world3", world_step(3), cap_s=400, min_s=60, share=0.4),
        Step("world4", world_step(4), cap_s=400, min_s=60),
        Step("bench_allreduce", step_bench_allreduce, cap_s=150, min_s=60),
    ],
}


def step_limit(step: Step, later: Sequence[Step], left: float) -> float:
    """The seconds ``step`` may take with ``left`` seconds to go: its cap, or
    its share of what the minimums promised to later steps leave, but never
    less than its own minimum while that much is left (when time is short,
    the last steps are the ones that go without)."""
    room = left - RESERVE_S
    free = room - sum(s.min_s for s in later)
    limit = min(step.cap_s, max(step.min_s, free * step.share), max(free, step.min_s))
    return max(0.0, min(limit, room))


def run_steps(run: Run, steps: Sequence[Step]) -> None:
    """Runs ``steps`` in order under the run's clock, saving after each. A
    step's status: passed, failed, incomplete (cases cut for time), cut (not
    run for time), skipped (after a fatal failure)."""
    stopped = ""
    for i, step in enumerate(steps):
        limit = step_limit(step, steps[i + 1:], run.left())
        rec: dict[str, Any] = {"name": step.name, "limit_s": round(limit)}
        if stopped:
            rec.update(status="skipped", reason=stopped)
            run.test(step.name, "skipped", stopped, step.name)
        elif limit < max(step.min_s, 1.0):
            rec.update(status="cut", reason=f"out of time ({limit:.0f} s left for it)")
            run.test(step.name, "cut", rec["reason"], step.name)
        else:
            run.log(f"{step.name}: up to {limit:.0f} s")
            t0, cut = time.monotonic(), run.summary["tests"]["cut"]
            run.summary["running"] = step.name
            try:
                ok = step.fn(run, limit)
            except Exception:  # noqa: BLE001 - a bug in one step must not end the run
                run.test(step.name, "failed", f"the step raised:\n{traceback.format_exc()}", step.name)
                ok = False
            run.summary.pop("running", None)
            status = "failed" if not ok else "incomplete" if run.summary["tests"]["cut"] > cut else "passed"
            rec.update(status=status, seconds=round(time.monotonic() - t0, 1))
            run.log(f"{step.name}: {rec['status']} in {rec['seconds']} s")
            if not ok and step.fatal:
                stopped = f"not run: step {step.name} failed"
        run.summary["steps"].append(rec)
        run.save()


def finish(run: Run) -> int:
    """Sets the run's status (failed, incomplete: something cut for time,
    passed), saves, logs; the exit status (1 unless passed)."""
    t = run.summary["tests"]
    run.summary["status"] = "failed" if t["failed"] else "incomplete" if t["cut"] else "passed"
    run.save()
    run.log(f"{run.summary['status']}: {t['passed']} passed, {t['failed']} failed, "
            f"{t['skipped']} skipped, {t['cut']} cut for time in {run.summary['wall_s']} s; "
            f"summary in {run.out / 'summary.json'}")
    for f in t["failures"]:
        run.log(f"FAILED {f['name']} ({f['status']})")
    for c in t["cuts"]:
        run.log(f"CUT {c['name']}: {c['reason']}")
    return 0 if run.summary["status"] == "passed" else 1


def _on_signal(run: Run) -> Callable[[int, Any], None]:
    """The SIGTERM/SIGINT handler: kills the running step's process group
    (it lives in a session of its own, out of reach of the outer timeout),
    saves the summary as "killed", and ends the driver (exit status 1)."""

    def handler(signum: int, frame: Any) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        proc, name = run.current, signal.Signals(signum).name
        if proc is not None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        step = run.summary.pop("running", "")
        if step:
            run.test(step, "killed", f"the driver got {name} during this step (the outer time "
                     "limit?); the step's processes were killed", step)
            run.summary["steps"].append({"name": step, "status": "killed"})
        run.summary.update(status="killed", reason=f"{name} after {time.monotonic() - run.start:.0f} s")
        run.save()
        run.log(f"killed by {name}: step {step or '-'} stopped; summary in {run.out / 'summary.json'}")
        raise Killed(name)

    return handler


def main_run(mode: str, out: Path, total_s: float) -> int:
    out.mkdir(parents=True, exist_ok=True)
    run = Run(mode, out, total_s)
    try:
        probe_gpu(run.summary)
    except NoGPU as e:
        run.close()
        run.summary.update(status=e.status, reason=str(e))
        run.save()
        print(f"gpu_check: {e.label}: {e}", flush=True)
        return 2
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _on_signal(run))
    try:
        return _run_mode(run)
    except Killed:
        return 1
    finally:
        run.close()


def _run_mode(run: Run) -> int:
    mode, total_s = run.mode, run.total_s
    if run.summary["commit"] == "unknown":
        run.log("WARNING: COMMIT UNKNOWN: this tree has no .git and GPU_CHECK_COMMIT is not set; "
                "rerun with GPU_CHECK_COMMIT=<sha from git rev-parse HEAD on your machine>")
    run.log(f"{mode} on {run.summary['device']} (torch {run.summary['torch']}, NCCL "
            f"{run.summary['nccl']}, {run.summary['gpus']} GPU(s)), commit {run.summary['commit']}, "
            f"{total_s:.0f} s")
    run_steps(run, MODES[mode])
    return finish(run)


# ------------------------------------------------------------------ render

def render(summaries: Sequence[dict[str, Any]]) -> str:
    """The README's GPU paragraph (Markdown) from one summary per mode."""
    parts = []
    for s in summaries:
        t = s["tests"]
        if s.get("status") == "no_gpu":
            parts.append(f"- `--{s['mode']}` on {s['date'][:10]}: not run ({s['reason']}).")
            continue
        cut = f", {t['cut']} cut for time" if t.get("cut") else ""
        status = f" ({s['status']})" if s.get("status") in ("incomplete", "killed") else ""
        head = (f"- `scripts/gpu_check.sh --{s['mode']}` on {s['date'][:10]}, commit "
                f"`{s['commit'][:12]}`, {s.get('device', '?')} (torch {s.get('torch')}, NCCL "
                f"{s.get('nccl')}, Python {s.get('python')}): {t['passed']} passed, "
                f"{t['failed']} failed, {t['skipped']} skipped{cut} in {s['wall_s']:.0f} s{status}.")
        lines = [head]
        lines += [f"  - failed: `{f['name']}` ({f['status']}): {_gist(f)}" for f in t["failures"]]
        lines += [f"  - cut for time: `{c['name']}`" for c in t.get("cuts", [])]
        kernel = s.get("benchmarks", {}).get("kernel")
        if kernel:
            cells = ", ".join(f"{r['dtype']} {r['reduce_GBps']} GB/s = {r['reduce_over_torch_add']}x"
                              for r in kernel["rows"])
            lines.append(f"  - reduction kernel at 256 MiB vs torch `add_`: {cells} "
                         f"(goal >= 1.0x: {'met' if kernel['goal']['met'] else 'not met'}).")
        parts.append("\n".join(lines))
    return "\n".join(parts)


def _gist(failure: dict[str, Any]) -> str:
    """One line for a failure: a hang's or a death's first line (what the
    runner says), else the traceback's last line (the exception)."""
    lines = [ln.strip() for ln in failure["traceback"].splitlines()
             if ln.strip() and not ln.startswith("---")]
    if not lines:
        return "(no traceback)"
    return (lines[0] if failure["status"] in ("hung", "died", "killed") else lines[-1])[:200]


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run the check, write OUTDIR/summary.json")
    r.add_argument("--mode", choices=sorted(MODES), required=True)
    r.add_argument("--out", required=True, type=Path)
    r.add_argument("--total", type=float, default=465.0, help="seconds for the whole run")
    p = sub.add_parser("render", help="the README's GPU paragraph from summaries")
    p.add_argument("summaries", nargs="+", type=Path)
    args = ap.parse_args(argv)
    if args.cmd == "render":
        print(render([json.loads(f.read_text()) for f in args.summaries]))
        return 0
    return main_run(args.mode, args.out, args.total)


if __name__ == "__main__":
    sys.exit(main())
