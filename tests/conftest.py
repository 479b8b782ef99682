"""Multi-process helpers: run a function on W ranks over gloo or qcomm.

``run_ranks(fn, world, *args)`` runs ``fn(rank, world, *args)`` on ``world`` processes,
each with the default group initialised (a FileStore in a fresh temp dir, so no port is
needed), and returns the per-rank results in rank order. A rank that raises fails the
test with its traceback; a run past ``timeout`` seconds is killed and fails, so nothing
hangs. ``dead`` names ranks expected to die without a result (their slot is None);
``pg_timeout`` is the process groups' timeout; ``env`` may be one dict for all ranks or
a list of one per rank.

The processes are kept between calls (:class:`_Pool`, one set per world size): spawning
``world`` interpreters that import torch cost 2.0-2.7 s a call at world 2 and 3.7-5.4 s
at 4 on a 2-core Xeon (run_ranks of a function that returns at once, timed from the
parent), and the suite's 73 calls (55 at world 2, 6 at 3, 12 at 4) spent an estimated
~225 s of its 875 s so. Each call sees what fresh processes would of qcomm and the
tests: the environment is the parent's at
the call (plus the call's), and afterwards the worker puts back what the call changed
in the modules of qcomm, bench and the tests (their globals, the contents of their
dict, set and list globals, their classes' attributes: a test that patches
``qcomm.pieces.PIECE`` or a method patches only its own call), torch's and Python's
random state, and torch's threads. Torch's own state is not put back: a worker whose
call made a DeviceMesh ends after it (a mesh's state outlives the process group), and
a call that needs a fresh torch otherwise says ``fresh=True`` (the bodies that
torch.compile). A call that fails, times out, or names ``dead`` ranks (or
``fresh=True``) runs in processes of its own, and a failure drops the kept ones.

Workers run with ``QCOMM_COMPILE=0`` (the eager codec: ``torch.compile`` costs ~25 s per
process and config; read into each group's config at its creation, and by direct codec
calls that name no path once per process, :func:`qcomm.config.env_config`) and one
intra-op thread each (2 shared cores). So does the test process itself, unless the
environment says otherwise: a test of the compiled path names it (``impl="torch"``,
``CommConfig(compile=True)``, or ``QCOMM_COMPILE=1`` for a subprocess).
"""

from __future__ import annotations

import io
import os
import queue
import random
import sys
import tempfile
import time
import traceback
from datetime import timedelta

import pytest
import torch
import torch.multiprocessing as mp

DEFAULT_TIMEOUT = 120.0
WORKER_ENV = {"QCOMM_COMPILE": "0", "OMP_NUM_THREADS": "1"}
os.environ.setdefault("QCOMM_COMPILE", "0")
# The modules whose state a kept worker puts back after each call (names or prefixes).
_RESTORED = ("qcomm", "bench", "test_", "conftest", "crossdevice")


def _run(rank, world, store_path, backend, env, fn, args, pg_timeout) -> tuple[str, object]:
    """One call on this rank: ("ok", the result as bytes) or ("error", a traceback)."""
    try:
        # each rank its own node unless the test says otherwise: under the default
        # QCOMM_TOPOLOGY=auto, ranks that share a node (one machine) send exact
        os.environ.setdefault("QCOMM_NODE", f"node{rank}")
        os.environ.update(env)
        torch.set_num_threads(1)
        import torch.distributed as dist

        import qcomm  # noqa: F401  (registers the backend)

        store = dist.FileStore(store_path, world)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                                timeout=timedelta(seconds=pg_timeout))
        try:
            out = fn(rank, world, *args)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
        buf = io.BytesIO()  # plain bytes: a tensor through the queue would be a shared
        torch.save(out, buf)  # memory handle that dies with this process
        return "ok", buf.getvalue()
    except BaseException:  # noqa: BLE001 (report everything to the parent)
        return "error", traceback.format_exc()


def _snapshot() -> tuple[list, list]:
    """The globals of the restored modules and the attributes of their classes; and the
    contents of their dict, set and list globals (registries a call fills in place:
    qcomm.purpose's twins, the topology's logged plans)."""
    saved, contents = [], []
    for name, mod in list(sys.modules.items()):
        if mod is None or not name.startswith(_RESTORED):
            continue
        names = vars(mod)
        saved.append((mod, dict(names)))
        for key, value in list(names.items()):
            if isinstance(value, type) and value.__module__ == name:
                saved.append((value, dict(vars(value))))
            elif type(value) in (dict, set, list) and not key.startswith("__"):
                contents.append((value, value.copy()))  # (not __builtins__: a dict)
    return saved, contents


def _restore(snapshot: tuple[list, list]) -> None:
    saved, contents = snapshot
    for container, before in contents:
        container.clear()
        (container.extend if isinstance(container, list) else container.update)(before)
    for owner, before in saved:
        now = vars(owner)
        added = [k for k in now if k not in before and k not in ("__dict__", "__weakref__")]
        changed = {k: v for k, v in before.items() if k not in now or now[k] is not v}
        if isinstance(owner, type):  # a class's namespace is read-only: through setattr
            for key in added:
                delattr(owner, key)
            for key, value in changed.items():
                setattr(owner, key, value)
        else:
            for key in added:
                del now[key]
            now.update(changed)


def _kept_worker(rank, world, tasks, results):
    """A kept rank: runs each task (:func:`_run`), then puts back what it changed
    (module docstring)."""
    torch.set_num_threads(1)
    import torch.distributed as dist  # noqa: F401

    import qcomm  # noqa: F401

    threads, switch = torch.get_num_threads(), sys.getswitchinterval()
    rng, py_rng = torch.random.get_rng_state(), random.getstate()
    # A call that made a DeviceMesh (FSDP2, DTensor, HSDP) leaves torch state that
    # outlives destroy_process_group: a later call's default mesh was seen to name a
    # group of the call before it ("Could not resolve the process group registered
    # under the name 1"). Such a worker ends after its call; the next one is fresh.
    from torch.distributed import device_mesh

    meshes, real_init = [], device_mesh.DeviceMesh.__init__

    def counted_init(self, *args, **kwargs):
        meshes.append(1)
        real_init(self, *args, **kwargs)

    device_mesh.DeviceMesh.__init__ = counted_init
    while (task := tasks.get()) is not None:
        task_id, env, call = task
        saved = _snapshot()
        os.environ.clear()
        os.environ.update(env)
        try:
            status, value = _run(rank, world, *call)
        finally:
            _restore(saved)
            torch.set_num_threads(threads)
            sys.setswitchinterval(switch)
            torch.random.set_rng_state(rng)
            random.setstate(py_rng)
        results.put((task_id, rank, status, value, bool(meshes)))  # True: ending
        if meshes:
            return


class _Pool:
    """``world`` kept ranks (:func:`_kept_worker`) and their queues."""

    def __init__(self, world: int) -> None:
        ctx = mp.get_context("spawn")
        self.tasks = [ctx.Queue() for _ in range(world)]
        self.results = ctx.Queue()
        self.procs = [ctx.Process(target=_kept_worker, daemon=True,
                                  args=(r, world, self.tasks[r], self.results))
                      for r in range(world)]
        for p in self.procs:
            p.start()
        self.calls = 0

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def close(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(timeout=5)


_pools: dict[int, _Pool] = {}


def pytest_sessionfinish(session, exitstatus):
    for pool in _pools.values():
        pool.close()
    _pools.clear()


def run_ranks(fn, world: int, *args, backend: str = "qcomm", env: dict | list | None = None,
              timeout: float = DEFAULT_TIMEOUT, dead: tuple[int, ...] = (),
              pg_timeout: float = 60.0, fresh: bool = False):
    """Run ``fn(rank, world, *args)`` on ``world`` processes; return results by rank."""
    envs = env if isinstance(env, list) else [env] * world
    own = bool(dead) or fresh  # processes of its own, closed after this call
    pool = _Pool(world) if own else _pools.get(world)
    if pool is None or not pool.alive():
        if pool is not None:
            pool.close()
        pool = _pools[world] = _Pool(world)
    with tempfile.TemporaryDirectory(prefix="qcomm-test-") as tmp:
        store_path = os.path.join(tmp, "store")
        pool.calls += 1
        parent = dict(os.environ)
        for r in range(world):
            pool.tasks[r].put((pool.calls, parent, (store_path, backend,
                                                    {**WORKER_ENV, **(envs[r] or {})}, fn,
                                                    args, pg_timeout)))
        ending = True
        try:
            got, ending = _collect(pool.results, pool.procs, world, pool.calls, timeout, dead)
            return got
        finally:
            # own: stopped or hung ranks meant to fail among them; failed: a rank may be
            # stuck in a collective its failed peer left; ending: the workers end after
            # this call (a DeviceMesh), and must not be given the next one while they exit
            if own or ending:
                pool.close()
                if _pools.get(world) is pool:
                    del _pools[world]


def _collect(results, procs, world: int, task_id, timeout: float,
             dead: tuple[int, ...]) -> tuple[list, bool]:
    """Every live rank's result of call ``task_id``, in rank order, and whether a rank's
    worker ends after it; fails the test on an error, a crash or the timeout."""
    got: dict[int, object] = {}
    ending = False
    errors: list[str] = []
    deadline = time.monotonic() + timeout
    alive = world - len(dead)
    while len(got) + len(errors) < alive:
        left = deadline - time.monotonic()
        if left <= 0:
            pytest.fail(f"multi-process test timed out after {timeout:.0f} s "
                        f"(ranks done: {sorted(got)}; errors: {errors})")
        try:
            call, rank, status, value, ends = results.get(timeout=min(left, 1.0))
        except queue.Empty:
            crashed = [p for r, p in enumerate(procs)
                       if p.exitcode not in (None, 0) and r not in dead]
            if crashed and not errors and len(got) + len(errors) < alive:
                # a rank died without reporting (segfault, os._exit)
                try:
                    call, rank, status, value, ends = results.get(timeout=2.0)
                except queue.Empty:
                    pytest.fail(f"rank process exited with {crashed[0].exitcode} "
                                "without a result")
            else:
                continue
        if call != task_id:
            continue  # not this call's (none are, but a kept worker's queue is long-lived)
        ending |= ends
        if status == "ok":
            got[rank] = torch.load(io.BytesIO(value), weights_only=False)
        else:
            errors.append(f"--- rank {rank} ---\n{value}")
            break  # peers of a failed rank would wait for it until the timeout
    if errors:
        pytest.fail("rank failed:\n" + "\n".join(errors), pytrace=False)
    return [got.get(r) for r in range(world)], ending


def make(rank: int, n: int, dtype: torch.dtype = torch.float32, salt: int = 0, *,
         spread: bool = True) -> torch.Tensor:
    """Rank ``rank``'s test input: ``n`` normal values, reproducible per (rank, salt);
    with ``spread`` scaled by ``1 + rank``, so ranks' ranges differ."""
    g = torch.Generator().manual_seed(1000 * salt + rank)
    x = torch.randn(n, generator=g)
    return (x * (1 + rank) if spread else x).to(dtype)


def bound(steps: torch.Tensor, q) -> torch.Tensor:
    """Error bound from steps: one step (stochastic) or half (nearest), with fp32 slack."""
    factor = 1.0 if q.rounding == "stochastic" else 0.5
    return steps * factor * 1.001 + 1e-6


def assert_within(actual: torch.Tensor, want: torch.Tensor, limit: torch.Tensor, what: str):
    """|actual - want| <= limit, plus the output dtype's own rounding of ``want``."""
    slack = limit + torch.finfo(actual.dtype).eps * want.float().abs()
    assert_close_where(actual, want, slack, f"{what} beyond the codec's bound")


def assert_close_where(actual: torch.Tensor, expected: torch.Tensor, atol,
                       what: str = "") -> None:
    """Assert |actual - expected| <= atol (a float or a per-element tensor), reporting
    the count and first positions of the elements that are not."""
    diff = (actual.float() - expected.float()).abs()
    bad = ~(diff <= atol)  # NaN counts as bad
    if bad.any():
        idx = bad.nonzero().flatten()[:8].tolist()
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {diff.numel()} elements off by more than {atol} "
            f"(max {diff.max().item():.3g}); first at {idx}"
        )
