"""torch's contracts on CUDA tensors (the GPU tier runs it: ``tests/test_gpu.py``; alone:
``python tests/cuda_contracts.py``); prints one ``ok``/``FAIL`` line per check, exits 1 on a FAIL.

1. ``init_process_group("qcomm", device_id=cuda:0)`` on NCCL, world size 1: the bound
   device, ``_get_backend``, a ``new_group`` from it, an all-reduce with AVG and
   PREMUL_SUM sent to NCCL as they are, every ``_c10d_functional`` op;
2. 2 ranks over gloo on CUDA tensors (``QCOMM_INNER=gloo``, compressed): an async
   all-gather and reduce-scatter issued from a side stream and waited on from another,
   the results checked against an exact gloo group's.

Needs a GPU; on a machine without one it says so and exits 0.
"""

from __future__ import annotations

import datetime
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

N = 1 << 16


def _report(results: list[tuple[str, bool, str]]) -> int:
    for name, ok, detail in results:
        print(f"{'ok  ' if ok else 'FAIL'} {name}: {detail}", flush=True)
    return 0 if all(ok for _, ok, _ in results) else 1


def _check(results, name, fn):
    try:
        detail = fn()
        results.append((name, True, detail or ""))
    except Exception as err:  # noqa: BLE001 (each check reports on its own)
        results.append((name, False, f"{type(err).__name__}: {str(err)[:300]}"))


def nccl_world_one(store_path: str) -> int:
    import qcomm  # noqa: F401

    results: list = []
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    dist.init_process_group("qcomm", store=dist.FileStore(store_path, 1), rank=0,
                            world_size=1, device_id=device,
                            timeout=datetime.timedelta(seconds=60))
    pg = dist.group.WORLD
    _check(results, "device_id binding", lambda: (
        f"bound {pg.bound_device_id}, backend {type(pg._get_backend(device)).__name__}"))

    def subgroup():
        g = dist.new_group([0])
        t = torch.ones(8, device=device)
        dist.all_reduce(t, group=g)
        assert torch.equal(t, torch.ones(8, device=device))
        return type(g).__name__

    _check(results, "new_group from a bound qcomm group", subgroup)

    def native_ops():
        t = torch.full((4096,), 3.0, device=device)
        dist.all_reduce(t, dist.ReduceOp.AVG)
        u = torch.full((4096,), 3.0, device=device)
        dist.all_reduce(u, dist._make_nccl_premul_sum(0.5))
        assert torch.equal(t, torch.full_like(t, 3.0)) and torch.equal(u, torch.full_like(u, 1.5))
        return "AVG and PREMUL_SUM exact on NCCL"

    _check(results, "native NCCL reduce ops", native_ops)

    def functional():
        f = torch.ops._c10d_functional
        x = torch.randn(N, device=device)
        name = pg.group_name
        outs = [f.all_gather_into_tensor(x, 1, name), f.reduce_scatter_tensor(x, "sum", 1, name),
                f.all_reduce(x, "sum", name), f.broadcast(x, 0, name),
                f.all_gather_into_tensor_out(x, 1, name, out=torch.empty_like(x))]
        for o in outs:
            assert torch.equal(f.wait_tensor(o), x)
        return f"{len(outs)} ops equal their input at world size 1"

    _check(results, "functional ops", functional)
    dist.destroy_process_group()
    return _report(results)


def _two_rank_body(rank: int, store_path: str, queue) -> None:
    os.environ.update(QCOMM_INNER="gloo", QCOMM_NODE=f"node{rank}")
    import qcomm  # noqa: F401

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    dist.init_process_group("qcomm", store=dist.FileStore(store_path, 2), rank=rank,
                            world_size=2, timeout=datetime.timedelta(seconds=60))
    ref = dist.new_group(backend="gloo")
    results: list = []
    side, other = torch.cuda.Stream(), torch.cuda.Stream()

    def streams(kind: str):
        gen = torch.Generator(device="cpu").manual_seed(rank)
        x = torch.randn(2 * N if kind == "reduce_scatter" else N, generator=gen).to(device)
        out = torch.empty(N if kind == "reduce_scatter" else 2 * N, device=device)
        with torch.cuda.stream(side):
            side.wait_stream(torch.cuda.current_stream())
            y = x * 1.0  # produced on the side stream: the collective must see it
            if kind == "all_gather":
                work = dist.all_gather_into_tensor(out, y, async_op=True)
            else:
                work = dist.reduce_scatter_tensor(out, y, async_op=True)
        with torch.cuda.stream(other):
            work.wait()
            got = out.clone()  # ordered after the collective by wait()
        other.synchronize()
        want = torch.empty_like(out)
        if kind == "all_gather":
            dist.all_gather_into_tensor(want, x, group=ref)
        else:
            dist.reduce_scatter_tensor(want, x, group=ref)
        err = ((got - want).norm() / want.norm()).item()
        assert err < 0.02, f"relative error {err:.3g}"
        return f"rel err {err:.2e}"

    for kind in ("all_gather", "reduce_scatter"):
        _check(results, f"async {kind} across streams (gloo, CUDA tensors)",
               lambda kind=kind: streams(kind))
    dist.destroy_process_group()
    queue.put((rank, results))


# Seconds the two ranks have together: their checks took ~10 s on an H200 (2026-12-04),
# process start and CUDA init included; under the device check's 60 s a test.
RANKS_TIMEOUT = 45.0


def collect(procs, queue, timeout: float = RANKS_TIMEOUT) -> dict:
    """Each rank's results from ``queue`` (``(rank, results)`` items), waiting until
    every rank has reported, one has exited without reporting (its peers would wait on
    it), or ``timeout`` seconds have passed; then every child still running is killed.
    A rank missing from the dict died or hung."""
    import queue as queues
    import time

    got: dict = {}
    deadline = time.monotonic() + timeout
    died = False
    while len(got) < len(procs) and time.monotonic() < deadline:
        try:
            rank, results = queue.get(timeout=1.0 if died else 0.5)
            got[rank] = results
        except queues.Empty:
            if died:  # the queue is drained
                break
            died = any(p.exitcode is not None and r not in got for r, p in enumerate(procs))
    for p in procs:  # a rank that reported exits on its own; any other is killed
        p.join(timeout=5 if len(got) == len(procs) else 0)
        if p.is_alive():
            p.kill()
            p.join(timeout=5)
    return got


def gloo_two_ranks(store_path: str) -> int:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_two_rank_body, args=(r, store_path, queue)) for r in range(2)]
    for p in procs:
        p.start()
    got = collect(procs, queue)
    results = [(f"rank {r}: {name}", ok, detail)
               for r in sorted(got) for name, ok, detail in got[r]]
    results += [(f"rank {r}", False, f"no results: exit code {p.exitcode} (died, or killed "
                 f"after {RANKS_TIMEOUT:.0f} s)") for r, p in enumerate(procs) if r not in got]
    return _report(results)


def main() -> int:
    if not torch.cuda.is_available():
        print("cuda_contracts: no GPU here; nothing checked")
        return 0
    print(f"torch {torch.__version__} on {torch.cuda.get_device_name(0)}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        rc = nccl_world_one(os.path.join(tmp, "store1"))
        rc |= gloo_two_ranks(os.path.join(tmp, "store2"))
    return rc


if __name__ == "__main__":
    sys.exit(main())
