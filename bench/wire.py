"""``python -m bench wire``: FSDP2 training's bytes as each host's network interface
counts them, against qcomm's counters and the codec's ratio.

Two hosts (network namespaces joined by a veth pair, unshaped unless ``--link`` names a
rate; needs root), one rank each. Per model and variant, each rank trains ``--steps``
FSDP2 steps and reads its interface's ``tx_bytes`` before and after
(``/sys/class/net/<dev>/statistics/tx_bytes``: every byte the host sent, TCP/IP framing
and ACKs included; a barrier on the default group before each read). Configs
(``--config``, qcomm's keys, each a :func:`qcomm.wrap` of the group): ``exact`` (every
collective off: gloo's own calls, counted), ``bits=8``, ``bits=4``. Models: ``demo``
(``python -m qcomm.demo``'s TinyLM, width 128) and ``mlp`` (an embedding 256 x 512, four
blocks of Linear(512, 2048) + Linear(2048, 512), a head; each block an FSDP module).

Per row, both hosts summed:

- ``logical/iface``: the bytes the exact collectives would send under a direct exchange
  (qcomm.stats' ``logical_bytes``) over what the interfaces sent: the true ratio;
- ``codec``: the codec's own ratio at the config's (first compressed collective's)
  quantization (fp32 over the payload of a 2^20-element tensor); ``of codec``:
  ``logical/iface`` over ``codec``;
- ``stats/iface``: qcomm.stats' ``wire_bytes`` over the interfaces' bytes.

    python -m bench wire                     # unshaped, 10 steps, both models
    python -m bench wire --link 100mbit      # the same behind a shaped link
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from pathlib import Path

import torch

from . import common
from .link import UNSHAPED, LinkError, ShapedLink, parse_rate, pin_this_rank, run_spec, worker_done

MODELS = ("demo", "mlp")
CONFIGS = ("exact", "bits=8", "bits=4")
COLUMNS = [
    common.Column("model", "model"),
    common.Column("variant", "variant"),
    common.Column("logical_mib", "logical(MiB)", "{:.2f}"),
    common.Column("iface_mib", "iface(MiB)", "{:.2f}"),
    common.Column("stats_mib", "stats wire(MiB)", "{:.2f}"),
    common.Column("control_mib", "of it control(MiB)", "{:.3f}"),
    common.Column("ratio", "logical/iface", "{:.2f}"),
    common.Column("codec", "codec", "{:.2f}"),
    common.Column("of_codec", "of codec", "{:.2f}"),
    common.Column("stats_vs_iface", "stats/iface", "{:.3f}"),
    common.Column("step_ms", "step(ms)", "{:.0f}"),
]


def _model(name: str):
    import torch.nn as nn

    from qcomm.demo import TinyLM

    if name == "demo":
        model = TinyLM(128)
        return model, list(model.layers), lambda x: model(x).float().square().mean()
    blocks = [nn.Sequential(nn.Linear(512, 2048), nn.ReLU(), nn.Linear(2048, 512))
              for _ in range(4)]
    model = nn.Sequential(nn.Embedding(256, 512), *blocks, nn.Linear(512, 256))
    return model, blocks, lambda x: model(x).square().mean()


def _tx_bytes(ifname: str) -> int:
    return int(Path(f"/sys/class/net/{ifname}/statistics/tx_bytes").read_text())


def worker(spec: dict) -> None:
    import time

    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    import qcomm
    from qcomm.config import comm_config_from_env

    pin_this_rank()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=spec["op_timeout"]))
    rank = dist.get_rank()
    ifname = os.environ["GLOO_SOCKET_IFNAME"]
    rows = []
    for model_name in spec["models"]:
        for variant, env in spec["configs"]:
            config = comm_config_from_env({**os.environ, **env})  # over the environment's
            group = qcomm.wrap(dist.group.WORLD, config)
            mesh = DeviceMesh.from_group(group, "cpu")
            torch.manual_seed(0)
            model, blocks, loss_of = _model(model_name)
            for block in blocks:
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
            opt = torch.optim.Adam(model.parameters(), lr=1e-3)
            g = torch.Generator().manual_seed(rank)
            dist.barrier()
            before, start = _tx_bytes(ifname), time.perf_counter()
            for _ in range(spec["steps"]):
                loss_of(torch.randint(0, 64, (8, 16), generator=g)).backward()
                opt.step()
                opt.zero_grad()
            took = time.perf_counter() - start
            dist.barrier()
            sent = _tx_bytes(ifname) - before
            s = qcomm.stats(group)
            rows.append({"model": model_name, "variant": variant, "rank": rank,
                         "codec": codec_ratio(config),
                         "iface": sent, "step_s": took / spec["steps"],
                         "logical": sum(v.logical_bytes for v in s.values()),
                         "wire": sum(v.wire_bytes for v in s.values()),
                         "control": sum(v.control_bytes for v in s.values()),
                         "compressed": sum(v.calls_compressed for v in s.values()),
                         "exact": sum(v.calls_exact for v in s.values())})
            dist.destroy_process_group(group)
    worker_done(spec, rank, rows)


def codec_ratio(config) -> float:
    """fp32 bytes over the payload bytes of a 2^20-element tensor at CommConfig
    ``config``'s first compressed collective's quantization (1 if none is)."""
    from qcomm import packed_nbytes

    q = next(filter(None, (config.all_gather, config.reduce_scatter, config.all_reduce)), None)
    return 1.0 if q is None else 4 * 2**20 / packed_nbytes(2**20, q)


def summarize(per_rank: list[list[dict]]) -> list[dict]:
    """One row per (model, variant): both hosts' bytes summed."""
    rows = []
    for parts in zip(*per_rank, strict=True):
        first = parts[0]
        iface = sum(p["iface"] for p in parts)
        logical = sum(p["logical"] for p in parts)
        wire = sum(p["wire"] for p in parts)
        ratio = logical / iface if iface else float("nan")
        rows.append({"model": first["model"], "variant": first["variant"],
                     "logical_mib": logical / 2**20, "iface_mib": iface / 2**20,
                     "stats_mib": wire / 2**20,
                     "control_mib": sum(p["control"] for p in parts) / 2**20,
                     "ratio": ratio, "codec": first["codec"],
                     "of_codec": ratio / first["codec"],
                     "stats_vs_iface": wire / iface if iface else float("nan"),
                     "step_ms": 1e3 * max(p["step_s"] for p in parts),
                     "calls_compressed": first["compressed"], "calls_exact": first["exact"],
                     "per_host": [{k: p[k] for k in ("iface", "logical", "wire", "control")}
                                  for p in parts]})
    return rows


def add_arguments(p: argparse.ArgumentParser, on_gpu: bool) -> None:
    p.add_argument("--link", default=UNSHAPED,
                   help="the link between the two hosts: 'unshaped' (default) or a rate "
                        "such as 100mbit (needs root either way)")
    p.add_argument("--models", type=common.arg(
        lambda t: common.parse_list(t, MODELS, "model")), default=list(MODELS))
    p.add_argument("--config", action="append", type=common.arg(common.parse_config),
                   metavar="SPEC", help="one variant, repeatable: qcomm's keys, e.g. "
                   "bits=4,scheme=nuq (default: " + " ".join(CONFIGS) + ")")
    p.add_argument("--steps", type=int, default=10, help="training steps per variant")
    p.add_argument("--timeout", type=float, default=1200, help="whole run, seconds")
    p.add_argument("--op-timeout", type=float, default=300, help="process groups' timeout")


def main(args) -> int:
    if args.link != UNSHAPED and parse_rate(args.link) is None:
        print(f"python -m bench wire: --link must be {UNSHAPED!r} or a rate, got "
              f"{args.link!r}", file=sys.stderr)
        return 2
    header = common.run_header("wire", device="cpu (gloo)", link=args.link,
                               command=args.command)
    configs = args.config or [common.parse_config(c) for c in CONFIGS]
    header["sweep"] = {"models": args.models, "configs": [label for label, _ in configs],
                       "steps": args.steps, "world": 2}
    print(common.format_header(header), flush=True)
    spec = {"models": args.models, "configs": configs, "steps": args.steps,
            "op_timeout": args.op_timeout}
    try:
        with ShapedLink(args.link) as link:
            per_rank = run_spec("bench.wire", spec, 2, timeout_s=args.timeout, link=link,
                                env={"QCOMM_COMPILE": os.environ.get("QCOMM_COMPILE", "0")})
    except LinkError as err:
        print(f"python -m bench wire: {err}", file=sys.stderr)
        return 2
    rows = summarize(per_rank)
    common.report("wire", header, COLUMNS, rows, args.out, f"wire-{args.link}")
    return 0


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--worker":
    worker(json.loads(Path(sys.argv[2]).read_text()))
