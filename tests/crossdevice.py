"""The "qcomm" backend gives the same bits on CUDA as on CPU (the GPU tier runs it:
``tests/test_gpu.py``; alone: ``python tests/crossdevice.py``).

Two ranks run one fixed sequence of collectives through ``torch.distributed`` (the
user's path: ``init_process_group("qcomm")``), once on CPU tensors and once on CUDA
tensors, with the inner group on gloo both times (two ranks can share one GPU on gloo,
not on NCCL). The codec's Triton kernels (CUDA) and torch path (CPU) produce the same
bytes for the same seed, and the collectives seed by call number and rank, so every
output must match bit for bit across devices, and ``qcomm.stats`` must show the calls
compressed. A mismatch names the collective, dtype and config.

Runs anywhere; without CUDA it only runs the CPU side (a smoke test of the script).
Writes a JSON summary with ``--out FILE``.

    python tests/crossdevice.py [--out crossdevice.json]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import tempfile
import time
from datetime import timedelta

import torch
import torch.multiprocessing as mp

WORLD = 2
# (label, env) per config: what FSDP users pick (8-bit everything; 4-bit with nearest
# weights and small buckets; nuq gradients).
CONFIGS = [
    ("w8g8", {"QCOMM_AG_BITS": "8", "QCOMM_RS_BITS": "8", "QCOMM_AR_BITS": "8"}),
    ("w4g4-nuq", {"QCOMM_AG_BITS": "4", "QCOMM_AG_ROUNDING": "nearest", "QCOMM_AG_BUCKET": "128",
                  "QCOMM_RS_BITS": "4", "QCOMM_RS_SCHEME": "nuq", "QCOMM_AR_BITS": "4",
                  "QCOMM_AR_SCHEME": "maxnorm"}),
    ("w2g3", {"QCOMM_AG_BITS": "2", "QCOMM_RS_BITS": "3", "QCOMM_AR_BITS": "3",
              "QCOMM_RS_NORM": "l2", "QCOMM_RS_SCHEME": "nuq"}),
]
SIZES = (1, 4097, 300_003)  # per-rank elements: tiny (exact), a partial bucket, many buckets
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _inputs(rank: int, n: int, dtype: torch.dtype, salt: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(7919 * salt + 31 * n + rank)
    x = torch.randn(WORLD * n, generator=g) * torch.rand(WORLD * n, generator=g) ** 2
    return x.to(dtype)


def _sequence(device: torch.device) -> dict[str, torch.Tensor]:
    """The collectives every run performs, in one fixed order; outputs on CPU."""
    import torch.distributed as dist

    rank = dist.get_rank()
    # torch 2.13 renamed the flat forms (the old names warn); the GPU image has 2.11.
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    outs: dict[str, torch.Tensor] = {}
    for dtype in DTYPES:
        for n in SIZES:
            tag = f"{str(dtype).split('.')[-1]}-{n}"
            x = _inputs(rank, n, dtype, 0).to(device)
            shard = x[:n].clone()
            out = torch.empty(WORLD * n, dtype=dtype, device=device)
            all_gather(out, shard)
            outs[f"all_gather-{tag}"] = out.cpu()
            for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
                o = torch.empty(n, dtype=dtype, device=device)
                reduce_scatter(o, x, op)
                outs[f"reduce_scatter-{op}-{tag}"] = o.cpu()
            y = _inputs(rank, n, dtype, 1).to(device)
            dist.all_reduce(y)
            outs[f"all_reduce-{tag}"] = y.cpu()
    return outs


def _worker(rank, store_path, device_type, env, results):
    try:
        # each rank a node of its own: ranks of one host are one node, which qcomm's
        # topology sends exact (the 2026-12-04 lease's run compressed nothing)
        os.environ.setdefault("QCOMM_NODE", f"node{rank}")
        os.environ.update(env)
        torch.set_num_threads(1)
        import torch.distributed as dist

        import qcomm

        device = torch.device("cuda", 0) if device_type == "cuda" else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        store = dist.FileStore(store_path, WORLD)
        dist.init_process_group("qcomm", store=store, rank=rank, world_size=WORLD,
                                timeout=timedelta(seconds=60))
        try:
            outs = _sequence(device)
            stats = {k: vars(v) for k, v in qcomm.stats().items()}
        finally:
            dist.destroy_process_group()
        buf = io.BytesIO()
        torch.save({"outs": outs, "stats": stats}, buf)
        results.put((rank, "ok", buf.getvalue()))
    except BaseException:  # noqa: BLE001 (report everything to the parent)
        import traceback

        results.put((rank, "error", traceback.format_exc()))


def run_side(device_type: str, env: dict, timeout_s: float = 300) -> list[dict]:
    """Run the sequence on ``WORLD`` spawned ranks; per-rank {"outs", "stats"}."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    env = {"QCOMM_INNER": "gloo", "QCOMM_COMPILE": "0", "OMP_NUM_THREADS": "1", **env}
    with tempfile.TemporaryDirectory(prefix="qcomm-xdev-") as tmp:
        procs = [ctx.Process(target=_worker, daemon=True,
                             args=(r, os.path.join(tmp, "store"), device_type, env, results))
                 for r in range(WORLD)]
        for p in procs:
            p.start()
        got = {}
        deadline = time.monotonic() + timeout_s
        try:
            while len(got) < WORLD:
                rank, status, payload = results.get(timeout=max(1.0, deadline - time.monotonic()))
                if status != "ok":
                    raise RuntimeError(f"{device_type} rank {rank} failed:\n{payload}")
                got[rank] = torch.load(io.BytesIO(payload))
        finally:
            for p in procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
    return [got[r] for r in range(WORLD)]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of ``t``, as an integer tensor of the same element size."""
    return t.reshape(-1).view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def compare(cpu: list[dict], cuda: list[dict]) -> list[str]:
    """One line per output whose bits differ between the two sides (NaN payloads and
    signed zeros included: a value comparison would hide them), with examples."""
    bad = []
    for rank in range(WORLD):
        for name, a in cpu[rank]["outs"].items():
            b = cuda[rank]["outs"][name]
            if a.dtype != b.dtype or a.shape != b.shape:
                bad.append(f"rank {rank} {name}: {a.dtype}{tuple(a.shape)} on cpu, "
                           f"{b.dtype}{tuple(b.shape)} on cuda")
                continue
            differ = (_bits(a) != _bits(b)).nonzero().flatten()
            if differ.numel():
                i = differ[:3]
                m = (1 << 8 * a.element_size()) - 1
                pairs = ", ".join(
                    f"[{j}] cpu {x:.6g} (0x{xb & m:x}) cuda {y:.6g} (0x{yb & m:x})"
                    for j, x, y, xb, yb in zip(i.tolist(), a.reshape(-1)[i].tolist(),
                                               b.reshape(-1)[i].tolist(), _bits(a)[i].tolist(),
                                               _bits(b)[i].tolist(), strict=True))
                bad.append(f"rank {rank} {name}: {differ.numel()} of {a.numel()} differ: {pairs}")
    return bad


# What both sides must count alike. control_bytes differ by design: CPU groups check a
# 48-byte descriptor per call, CUDA groups check headers after the fact (no host sync).
COUNTED = ("calls_compressed", "calls_exact", "logical_bytes", "wire_bytes")


def same_counters(a: dict, b: dict) -> bool:
    return all(a[k][c] == b[k][c] for k in a for c in COUNTED)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python tests/crossdevice.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="write a JSON summary here")
    p.add_argument("--configs", default=",".join(c for c, _ in CONFIGS),
                   help="comma list of configs to run (default: all)")
    args = p.parse_args(argv)
    wanted = [c for c in args.configs.split(",") if c]
    unknown = sorted(set(wanted) - {c for c, _ in CONFIGS})
    if unknown:
        p.error(f"unknown --configs {unknown}; known: {[c for c, _ in CONFIGS]}")
    has_cuda = torch.cuda.is_available()
    report = {"torch": torch.__version__, "cuda": has_cuda,
              "device": torch.cuda.get_device_name(0) if has_cuda else "cpu only",
              "configs": {}}
    failed = False
    for label, env in CONFIGS:
        if label not in wanted:
            continue
        t0 = time.monotonic()
        cpu = run_side("cpu", env)
        entry = {"env": env, "outputs": len(cpu[0]["outs"]),
                 "stats_rank0": cpu[0]["stats"]}
        compressed = sum(s["calls_compressed"] for s in cpu[0]["stats"].values())
        if not compressed:
            failed = True
            entry["error"] = "no call was compressed"
        if has_cuda:
            cuda = run_side("cuda", env)
            mismatches = compare(cpu, cuda)
            stats_equal = same_counters(cpu[0]["stats"], cuda[0]["stats"])
            entry.update(mismatches=mismatches, stats_equal=stats_equal,
                         stats_rank0_cuda=cuda[0]["stats"])
            failed |= bool(mismatches) or not stats_equal
        entry["seconds"] = round(time.monotonic() - t0, 1)
        report["configs"][label] = entry
        verdict = ("cpu only" if not has_cuda else
                   "IDENTICAL" if not entry["mismatches"] and entry["stats_equal"] else
                   f"MISMATCH ({len(entry['mismatches'])})")
        print(f"{label:10s} {entry['outputs']} outputs x {WORLD} ranks, {compressed} calls "
              f"compressed on rank 0: cpu vs cuda {verdict} ({entry['seconds']} s)", flush=True)
        for line in entry.get("mismatches", [])[:10]:
            print(f"    {line}")
    report["passed"] = not failed
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1, default=str)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
