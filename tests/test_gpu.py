"""The GPU tier's own tests (``pytest -m gpu``; skipped without CUDA): the backend on CUDA
tensors against CPU tensors bit for bit with compression on, torch's contracts on CUDA,
FSDP2 steps on CUDA through both routes. The kernel, row and state-update tests
(tests/test_kernels.py, test_rows.py, test_update_state.py) are in the tier too: they
run on CUDA where it exists and through Triton's interpreter on CPU (CI).

On one GPU NCCL refuses two ranks, so the 2-rank checks run gloo over CUDA tensors,
each rank a node of its own (``QCOMM_NODE``: ranks of one host would send exact).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from conftest import run_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                  reason="needs CUDA (pytest -m gpu)")]


def test_backend_on_cuda_equals_cpu_compressed():
    """crossdevice.py's sequence, every config: the same bits on CUDA as on CPU, and
    calls compressed (it fails a config that compressed nothing)."""
    import crossdevice

    assert crossdevice.main([]) == 0


def test_cuda_contracts():
    """device_id binding, native NCCL AVG / PREMUL_SUM, functional ops, async calls
    across streams (cuda_contracts.py)."""
    import cuda_contracts

    assert cuda_contracts.main() == 0


def _fsdp2_cuda_body(rank, world):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    import qcomm.fsdp
    from qcomm.demo import TinyLM, train

    torch.cuda.set_device(0)
    res = {}
    for route in ("backend", "hook", "exact"):
        group = dist.new_group(backend="qcomm" if route == "backend" else "gloo")
        torch.manual_seed(0)
        model = TinyLM(64).cuda()
        mesh = DeviceMesh.from_group(group, "cuda")
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        if route == "hook":
            qcomm.fsdp.compress(model)
        res[route] = train(model, rank, 3)
        res[route + "_compressed"] = sum(s.calls_compressed
                                         for s in qcomm.stats(group).values())
    return res


def test_fsdp2_on_cuda_both_routes():
    env = {"QCOMM_INNER": "gloo"}
    # under the device check's 60 s a test: the ranks' own failure comes first, named
    for r in run_ranks(_fsdp2_cuda_body, 2, backend="gloo", env=env, timeout=55):
        assert r["backend_compressed"] > 0 and r["hook_compressed"] > 0, r
        assert r["hook"] == r["backend"], r  # one driver, one config, one call order
        for a, e in zip(r["backend"], r["exact"], strict=True):
            assert abs(a - e) <= 0.02 * abs(e), r
