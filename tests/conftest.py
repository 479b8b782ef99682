"""Multi-process helpers: run a function on W spawned ranks over gloo or qcomm.

``run_ranks(fn, world, *args)`` spawns ``world`` processes, initialises the default
group in each (a FileStore in a fresh temp dir, so no port is needed), calls
``fn(rank, world, *args)`` and returns the per-rank results in rank order. A rank that
raises fails the test with its traceback; a run past ``timeout`` seconds is killed
and fails, so nothing hangs. ``dead`` names ranks expected to die without a result
(their slot is None); ``pg_timeout`` is the process groups' timeout; ``env`` may be
one dict for all ranks or a list of one per rank.

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


def _worker(rank, world, store_path, backend, env, fn, args, results, pg_timeout=60.0):
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
        results.put((rank, "ok", buf.getvalue()))
    except BaseException:  # noqa: BLE001 (report everything to the parent)
        results.put((rank, "error", traceback.format_exc()))


def run_ranks(fn, world: int, *args, backend: str = "qcomm", env: dict | list | None = None,
              timeout: float = DEFAULT_TIMEOUT, dead: tuple[int, ...] = (),
              pg_timeout: float = 60.0):
    """Run ``fn(rank, world, *args)`` on ``world`` processes; return results by rank."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    envs = env if isinstance(env, list) else [env] * world
    with tempfile.TemporaryDirectory(prefix="qcomm-test-") as tmp:
        store_path = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_worker, daemon=True,
                             args=(r, world, store_path, backend, {**WORKER_ENV, **(envs[r] or {})},
                                   fn, args, results, pg_timeout))
                 for r in range(world)]
        for p in procs:
            p.start()
        got: dict[int, object] = {}
        errors: list[str] = []
        try:
            deadline = time.monotonic() + timeout
            alive = world - len(dead)
            while len(got) + len(errors) < alive:
                left = deadline - time.monotonic()
                if left <= 0:
                    pytest.fail(f"multi-process test timed out after {timeout:.0f} s "
                                f"(ranks done: {sorted(got)}; errors: {errors})")
                try:
                    rank, status, value = results.get(timeout=min(left, 1.0))
                except queue.Empty:
                    crashed = [p for r, p in enumerate(procs)
                               if p.exitcode not in (None, 0) and r not in dead]
                    if crashed and not errors and len(got) + len(errors) < alive:
                        # a rank died without reporting (segfault, os._exit)
                        try:
                            rank, status, value = results.get(timeout=2.0)
                        except queue.Empty:
                            pytest.fail(f"rank process exited with {crashed[0].exitcode} "
                                        "without a result")
                    else:
                        continue
                if status == "ok":
                    got[rank] = torch.load(io.BytesIO(value), weights_only=False)
                else:
                    errors.append(f"--- rank {rank} ---\n{value}")
                    break  # peers of a failed rank would wait for it until the timeout
        finally:
            for r, p in enumerate(procs):
                if r in dead and p.is_alive():  # stopped or hung, meant to fail: no grace
                    p.kill()
            for p in procs:
                p.join(timeout=5)
                if p.is_alive():
                    p.kill()
                    p.join(timeout=5)
        if errors:
            pytest.fail("rank failed:\n" + "\n".join(errors), pytrace=False)
        return [got.get(r) for r in range(world)]


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
