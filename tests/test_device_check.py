"""bench/device_check.sh on a machine without CUDA: it refuses to start and says why;
its phase machinery, driven through its test mode (``QCOMM_CHECK_SELFTEST=1`` and the
``QCOMM_CHECK_*`` overrides), gives every phase a verdict, names what a pytest phase
failed, leaves a benchmark's partial files when its limit cuts it, and still packs
and summarizes on SIGTERM. Also tests/cuda_contracts.py's rank collection, which must
not wait on a dead rank nor leave one running."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import tarfile
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "device_check.sh"


def run_script(out: Path, **env) -> subprocess.CompletedProcess:
    """The script as a lease runs it, with ``env`` added (QCOMM_CHECK_* overrides)."""
    # TMPDIR: the script's results folder (kept after the run) goes with the test's
    full = dict(os.environ, OUT=str(out), PY=sys.executable, QCOMM_COMPILE="0",
                TMPDIR=str(out.parent), **env)
    return subprocess.run(["bash", str(SCRIPT)], cwd=ROOT, env=full, capture_output=True,
                          text=True, timeout=120)


def selftest(only: str, limits: str, **env) -> dict:
    """The environment of a self-test run of the phases ``only`` on the CPU."""
    return dict(QCOMM_CHECK_SELFTEST="1", QCOMM_CHECK_DEVICE="cpu", QCOMM_CHECK_ONLY=only,
                QCOMM_CHECK_LIMITS=limits, QCOMM_CHECK_GRACE="5", **env)


def verdict(summary: str, phase: str) -> str:
    """A phase's verdict and its indented lines in the summary."""
    lines = summary.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(phase + ": "))
    end = next((i for i in range(start + 1, len(lines)) if not lines[i].startswith("    ")),
               len(lines))
    return "\n".join(lines[start:end])


def packed(out: Path) -> dict[str, bytes]:
    with tarfile.open(out / "results.tgz") as tar:
        return {m.name.lstrip("./"): tar.extractfile(m).read() for m in tar.getmembers()
                if m.isfile()}


def test_script_parses():
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0


def test_refuses_without_cuda_and_says_why(tmp_path):
    (tmp_path / "summary.txt").write_text("a stale summary")
    run = run_script(tmp_path, CUDA_VISIBLE_DEVICES="")
    assert run.returncode == 2, run.stdout[-2000:]
    summary = (tmp_path / "summary.txt").read_text()
    assert summary.startswith("RESULT: NOT ok") and "refused: no CUDA" in summary
    assert "cuda: REFUSED" in summary and "sees no CUDA device" in summary
    assert "stale" not in summary
    assert "gpu-tier: not run" in summary and "memory: not run" in summary
    assert "summary.txt" in packed(tmp_path)


FAKE_TIER = '''
import time

import pytest

pytestmark = pytest.mark.gpu


@pytest.fixture
def broken():
    raise RuntimeError("fixture broke")


def test_fails():
    assert 1 == 2


def test_errors(broken):
    pass


@pytest.mark.xfail(reason="expected to fail, passes")
def test_passes_unexpectedly():
    pass


@pytest.mark.xfail(reason="known")
def test_fails_as_expected():
    assert False


def test_hangs():
    time.sleep(120)
'''

FAKE_OWN = '''
import pytest

pytestmark = pytest.mark.gpu


def test_runs():
    pass


def test_skips():
    pytest.skip("needs CUDA")
'''


def fake_tests(folder: Path, name: str, text: str) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(textwrap.dedent(text))
    return str(folder / name)


@pytest.fixture(scope="module")
def phases(tmp_path_factory):
    """One self-test run of three phases on the CPU: gpu-tier over tests that fail, error,
    XPASS and hang (cut at 3 s), gpu-own over tests of which one skips, and breakeven,
    which runs minutes on the CPU, cut at 6 s. (summary, archive, exit status)."""
    tmp = tmp_path_factory.mktemp("phases")
    run = run_script(tmp / "out", **selftest(
        "gpu-tier gpu-own breakeven", "gpu-tier=3 gpu-own=30 breakeven=6",
        QCOMM_CHECK_TESTS_GPU_TIER=fake_tests(tmp / "tier", "test_tier.py", FAKE_TIER),
        QCOMM_CHECK_TESTS_GPU_OWN=fake_tests(tmp / "own", "test_own.py", FAKE_OWN)))
    return (tmp / "out" / "summary.txt").read_text(), packed(tmp / "out"), run


def test_a_run_not_all_ok_exits_non_zero_with_every_phase_named(phases):
    summary, files, run = phases
    assert run.returncode == 1, run.stdout[-3000:]
    assert summary.startswith("SELF-TEST") and "RESULT: NOT ok: 7 of 7 phases" in summary
    assert verdict(summary, "codec-fp32").startswith("codec-fp32: SKIPPED")
    assert verdict(summary, "cpu-suite").startswith("cpu-suite: SKIPPED")
    assert files["summary.txt"].decode() == summary


def test_a_pytest_phase_names_what_failed_even_when_cut(phases):
    summary, files, _ = phases
    mine = verdict(summary, "gpu-tier")
    assert mine.startswith("gpu-tier: CUT at its limit of 3 s"), mine
    for named in ("FAILED ", "test_tier.py::test_fails", "ERROR ", "test_errors",
                  "XPASS ", "test_passes_unexpectedly", "1 failed", "1 xfailed",
                  "running when cut: ", "test_tier.py::test_hangs"):
        assert named in mine, (named, mine)
    assert "gpu-tier.xml" in files  # the JUnit XML, written after the SIGINT


def test_a_phase_that_must_run_every_test_fails_on_skips(phases):
    mine = verdict(phases[0], "gpu-own")
    assert mine.startswith("gpu-own: FAILED: tests skipped where every one must run"), mine
    assert "SKIPPED " in mine and "needs CUDA" in mine and "1 passed, 1 skipped" in mine


def test_a_cut_benchmark_leaves_its_files_and_verdict(phases):
    """Cut by SIGINT, breakeven writes what it measured (its exact-path points come
    first); every target still has its line, met or not."""
    summary, files, _ = phases
    mine = verdict(summary, "breakeven")
    assert mine.startswith("breakeven: CUT at its limit of 6 s"), mine
    assert "wrote breakeven/breakeven-cpu.json" in mine and "interrupted after" in mine
    data = json.loads(files["breakeven/breakeven-cpu.json"])
    sweep = data["header"]["sweep"]
    assert sweep["points_measured"] == len(data["rows"]) + len(data["header"]["exact_path"])
    assert "breakeven.log" in files and "verdicts/breakeven.txt" in files
    targets = [line for line in summary.splitlines() if line.startswith("TARGET ")]
    # pytest, codec, break-even, exact path, auto's choices
    assert len(targets) == 1 + 12 + 3 + 3 + 1, targets
    assert all(line.endswith((": met", ": NOT met")) for line in targets), targets
    assert "TARGET break-even all_gather, W = 8, 2^24 elements, 8 bits: not measured" in summary


def test_sigterm_stops_the_phase_then_packs_and_summarizes(tmp_path):
    """A device call cut by its own timeout sends SIGTERM: the running phase gets SIGINT
    (pytest prints its summary, naming the test it stopped), its verdict says so, and
    the summary and the archive are written before the script exits 143."""
    env = dict(os.environ, OUT=str(tmp_path / "out"), PY=sys.executable,
               TMPDIR=str(tmp_path), **selftest(
        "gpu-tier", "gpu-tier=120",
        QCOMM_CHECK_TESTS_GPU_TIER=fake_tests(tmp_path, "test_tier.py", FAKE_TIER)))
    proc = subprocess.Popen(["bash", str(SCRIPT)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        log = tmp_path / "out" / "log.txt"
        for _ in range(300):  # until the phase has started, then a moment for pytest
            if log.exists() and "phase gpu-tier" in log.read_text():
                break
            time.sleep(0.1)
        time.sleep(2)
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, output[-3000:]
    summary = (tmp_path / "out" / "summary.txt").read_text()
    assert "RESULT: NOT ok" in summary and "stopped by SIGTERM" in summary
    mine = verdict(summary, "gpu-tier")
    assert mine.startswith("gpu-tier: STOPPED by SIGTERM"), mine
    assert "running when cut: " in mine and "test_tier.py::test_hangs" in mine
    assert "FAILED " in mine and "test_fails" in mine
    assert verdict(summary, "breakeven") == "breakeven: not run"  # stopped before it
    files = packed(tmp_path / "out")
    assert "gpu-tier.xml" in files and files["summary.txt"].decode() == summary


def test_cuda_contracts_stop_waiting_for_a_dead_rank_and_kill_the_rest():
    """A rank that exits without reporting ends the wait; the rank still running (asleep
    for a minute) is killed, not waited for; a rank that reports is kept."""
    import queue as queues

    sys.path.insert(0, str(ROOT / "tests"))
    try:
        import cuda_contracts
    finally:
        sys.path.pop(0)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=q.put, args=((0, [("check", True, "")]),)),
             ctx.Process(target=os._exit, args=(3,)),
             ctx.Process(target=time.sleep, args=(60,))]
    for p in procs:
        p.start()
    got = cuda_contracts.collect(procs, q, timeout=50)
    assert got == {0: [("check", True, "")]}
    assert [p.exitcode for p in procs] == [0, 3, -signal.SIGKILL]
    with pytest.raises(queues.Empty):
        q.get(timeout=0.1)
