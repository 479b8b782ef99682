"""``python -m bench memory``: peak memory per rank of FSDP2 training, plain FSDP2 against
qcomm, with and without its per-module state (weight differences, error feedback).

Each variant trains the same model for ``--steps`` AdamW steps on ``--world`` ranks, each
variant in fresh processes (a peak is a per-process high-water mark): ``--layers``
blocks of two ``--width`` x ``--width`` linear layers, ``fully_shard`` per block and at
the root, built on the meta device and materialized sharded, so no rank ever holds the
whole model (a full CPU init would set the peak before training starts). Configs
(``--config``, as ``python -m bench train`` takes them; the default five):

- ``exact``: plain FSDP2 on the gloo group (the reference);
- ``bits=4,ag_rounding=nearest,ag_bucket=128``: qcomm's 4-bit all-gather and
  reduce-scatter, no state;
- ``...,deltas=1,state=32``: with weight differences kept in fp32 (4 bytes per unsharded
  parameter on every rank), ``deltas=1`` the default
  8-bit state, ``state=dtype`` the parameters' dtype; ``feedback=1`` adds error
  feedback's residuals.

``--param-dtype bfloat16`` gathers bf16 parameters (FSDP2's MixedPrecisionPolicy, fp32
gradient reduction), so ``state=dtype`` keeps 2 bytes a parameter.

The ranks run with ``MALLOC_MMAP_THRESHOLD_=131072``: every block over 128 KiB is its
own mapping, returned when freed, so RSS follows the live tensors (glibc's default
threshold grows with the blocks freed, and then freed tensors stay resident: two runs
of one state measured 88 MiB apart that way).

Per rank: ``peak`` (the process's peak RSS, ``ru_maxrss``), ``state``
(``state_nbytes()`` of qcomm.fsdp's collectives), the steady RSS after the steps and
``compressed``, the calls qcomm sent compressed (``qcomm.stats``). Reported per config:
the largest rank's, and its excess over ``exact``'s.

Exit status 1 when a qcomm variant compressed nothing (its peak would be plain FSDP2's:
ranks of one node send exact) or a variant failed (the others still run), 130 when
interrupted (Ctrl-C, ``timeout -s INT``): the variants measured by then are written all
the same.

``--device cuda`` (``bench/device_check.sh``): rank r trains on ``cuda:r % count`` and
``peak`` is ``torch.cuda.max_memory_allocated`` over the whole run (``steady``: allocated
after the steps), the host's RSS beside it. Ranks get NCCL where every rank has a GPU of
its own, else gloo over CUDA tensors (``QCOMM_INNER=gloo`` under qcomm), since NCCL
refuses two ranks on one GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
from pathlib import Path

import torch

from . import common
from .common import Column
from .link import pin_this_rank, run_spec, worker_done
from .train import install_stateful, parse_config

MMAP_THRESHOLD = 128 * 1024  # bytes: larger blocks are mapped, and unmapped when freed
Q4 = "bits=4,ag_rounding=nearest,ag_bucket=128"
CONFIGS = ("exact", Q4, Q4 + ",deltas=1,state=32", Q4 + ",deltas=1,state=dtype",
           Q4 + ",deltas=1")


def add_arguments(p: argparse.ArgumentParser, on_gpu: bool) -> None:
    p.add_argument("--config", action="append", type=common.arg(parse_config),
                   metavar="SPEC", help="one variant, repeatable: exact (plain FSDP2) or "
                   "bench train's keys, e.g. bits=4,deltas=1,state=32 (default: the five "
                   "above)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--width", type=int, default=2048,
                   help="blocks of two width x width linear layers (default 2048: 8 blocks "
                        "are 67M parameters, 268 MB in fp32)")
    p.add_argument("--batch", type=int, default=16, help="rows per rank and step")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--param-dtype", default="float32", choices=("float32", "bfloat16"),
                   help="the dtype FSDP2 gathers and computes in (default float32)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="cuda: peak torch.cuda.max_memory_allocated per rank (default cpu)")
    p.add_argument("--timeout", type=float, default=900, help="seconds per variant")


# ----------------------------------------------------------------------------- rank


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def cuda_backend(world: int) -> str:
    """The exact backend of ``world`` ranks on this machine's GPUs: NCCL where each rank
    has a GPU of its own, else gloo (NCCL refuses two ranks on one GPU)."""
    return "nccl" if world <= torch.cuda.device_count() else "gloo"


def rank_device(kind: str) -> torch.device:
    """This rank's device: for ``cuda`` a GPU by its rank (round the GPUs), made the
    current one; else the CPU."""
    if kind != "cuda":
        return torch.device("cpu")
    device = torch.device("cuda", int(os.environ["RANK"]) % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device


def worker(spec: dict) -> None:
    """One variant on this rank; its row goes back through :func:`worker_done`."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    import qcomm  # registers the backend

    pin_this_rank()
    name = spec["name"]
    on_cuda = spec["device"] == "cuda"
    exact = cuda_backend(int(os.environ["WORLD_SIZE"])) if on_cuda else "gloo"
    device = rank_device(spec["device"])
    dist.init_process_group(exact if name == "exact" else "qcomm")
    rank = dist.get_rank()
    width = spec["width"]
    with torch.device("meta"):
        blocks = [torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.GELU(),
                                      torch.nn.Linear(width, width))
                  for _ in range(spec["layers"])]
        model = torch.nn.Sequential(*blocks)
    kwargs = {}
    if spec["param_dtype"] == "bfloat16":
        from torch.distributed.fsdp import MixedPrecisionPolicy

        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                   reduce_dtype=torch.float32)
    for block in blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    model.to_empty(device=device)  # each rank allocates its shards only
    gen = torch.Generator(device=device).manual_seed(rank)
    with torch.no_grad():
        for p in model.parameters():
            local = p.to_local()
            local.normal_(0.0, 1.0 / width ** 0.5, generator=gen)
    comms = install_stateful(model, name)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(spec["batch"], width, generator=gen, device=device)
    rss_before = _rss_bytes()
    for _ in range(spec["steps"]):
        loss = model(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    row = {"rank": rank, "params": sum(p.numel() for p in model.parameters()),
           "rss_before": rss_before, "rss_after": _rss_bytes(),
           # Linux: ru_maxrss in KiB
           "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
           "state": sum(c.state_nbytes() for c in comms), "loss": loss.item(),
           "compressed": 0 if name == "exact" else sum(
               s.calls_compressed for s in qcomm.stats().values())}
    if on_cuda:  # the GPU's figures replace the host's as peak and steady
        torch.cuda.synchronize(device)
        row.update(host_peak_rss=row["peak_rss"], host_rss_after=row["rss_after"],
                   peak_rss=torch.cuda.max_memory_allocated(device),
                   rss_after=torch.cuda.memory_allocated(device),
                   reserved_peak=torch.cuda.max_memory_reserved(device))
    worker_done(spec, rank, row)


# ----------------------------------------------------------------------------- driver


def run_variant(args, name: str, env: dict) -> dict:
    env = dict(env, MALLOC_MMAP_THRESHOLD_=str(MMAP_THRESHOLD))
    if args.device == "cuda" and name != "exact" and cuda_backend(args.world) == "gloo":
        env["QCOMM_INNER"] = "gloo"
    spec = {"name": name, "device": args.device, "layers": args.layers,
            "width": args.width, "batch": args.batch, "steps": args.steps,
            "param_dtype": args.param_dtype}
    ranks = run_spec("bench.memory", spec, args.world, timeout_s=args.timeout, env=env)
    top = max(ranks, key=lambda r: r["peak_rss"])
    return {"variant": name, "params": top["params"], "peak": top["peak_rss"],
            "rss_after": max(r["rss_after"] for r in ranks),
            "state": max(r["state"] for r in ranks),
            "state_per_param": max(r["state"] for r in ranks) / top["params"],
            "compressed": min(r["compressed"] for r in ranks), "ranks": ranks}


def columns() -> list[Column]:
    mib = "{:.1f}"
    return [Column("variant", "variant"), Column("params", "params"),
            Column("peak_mib", "peak MiB", mib), Column("over_mib", "over exact MiB", mib),
            Column("state_mib", "state MiB", mib),
            Column("state_per_param", "state B/param", "{:.2f}"),
            Column("rss_after_mib", "RSS after MiB", mib),  # on CUDA: allocated after
            Column("compressed", "compressed calls")]


def main(args) -> int:
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench memory --device cuda: torch sees no CUDA device here")
    header = common.run_header("memory", device=args.device, command=args.command)
    configs = args.config or [parse_config(c) for c in CONFIGS]
    header["sweep"] = {"configs": [name for name, _ in configs], "layers": args.layers,
                       "width": args.width, "batch": args.batch, "steps": args.steps,
                       "world": args.world, "param_dtype": args.param_dtype,
                       "malloc_mmap_threshold": MMAP_THRESHOLD,
                       "peak": "ru_maxrss" if args.device == "cpu"
                       else "torch.cuda.max_memory_allocated"}
    if args.device == "cuda":
        header["sweep"]["backend"] = cuda_backend(args.world)
    print(common.format_header(header), flush=True)
    rows, failed, interrupted = [], [], False
    for name, env in configs:
        try:
            row = run_variant(args, name, env)
        except KeyboardInterrupt:  # Ctrl-C (or `timeout -s INT`): keep what was measured
            interrupted = True
            print(f"# interrupted after {len(rows)} of {len(configs)} variants: reporting "
                  "those", file=sys.stderr, flush=True)
            break
        except (RuntimeError, TimeoutError) as err:  # a rank failed: the others still run
            failed.append(name)
            print(f"# {name} FAILED: {err}", file=sys.stderr, flush=True)
            continue
        rows.append(row)
        print(f"# {name}: peak {row['peak'] / 2**20:.1f} MiB, state "
              f"{row['state'] / 2**20:.1f} MiB, {row['compressed']} calls compressed",
              file=sys.stderr, flush=True)
    header["sweep"]["variants_measured"] = len(rows)
    base = next((r["peak"] for r in rows if r["variant"] == "exact"), None)
    for r in rows:
        r["peak_mib"], r["state_mib"] = r["peak"] / 2**20, r["state"] / 2**20
        r["rss_after_mib"] = r["rss_after"] / 2**20
        r["over_mib"] = None if base is None else (r["peak"] - base) / 2**20
    common.report("memory", header, columns(), rows, args.out,
                  "memory" + ("-cuda" if args.device == "cuda" else "")
                  + ("-bf16" if args.param_dtype == "bfloat16" else ""))
    plain = [r["variant"] for r in rows if r["variant"] != "exact" and not r["compressed"]]
    if plain:
        print(f"# memory: {', '.join(plain)} compressed nothing", file=sys.stderr)
    if failed:
        print(f"# memory: {', '.join(failed)} failed", file=sys.stderr)
    if plain or failed or not rows:
        return 1
    return 130 if interrupted else 0


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--worker":
    worker(json.loads(Path(sys.argv[2]).read_text()))
