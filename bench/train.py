"""``python -m bench train``: FSDP2 GPT training on real text, exact vs quantized
communication (QSDP's claim: same loss, faster), ranks self-launched.

Data: the bytes of the Python standard library's ``.py`` files, in sorted path order; the
last 5% of files are held out for evaluation. Byte-level tokens (vocabulary 256), so
nothing is downloaded and nothing is shipped.

Model: a nanoGPT-shaped decoder (pre-LayerNorm, causal attention, 4x GELU MLP, tied
embedding), ``fully_shard`` per block and at the root, AdamW with warm-up and cosine
decay. Every variant starts from the same initial weights; a data seed fixes the order of
the training windows, the same for every variant (paired runs).

Configs (``--config``, one variant each; its text labels the runs): ``exact`` (every
collective exact through the inner gloo: the baseline), else qcomm's keys
(:func:`qcomm.config.env_from_keys`, the run's ``QCOMM_*`` environment: ``bits=8``,
``ag_bits=4,rs_bits=8``, ``bits=4,scheme=nuq``, ``topology=flat``, ...) and the bench's
own keys for :mod:`qcomm.fsdp`'s stateful collectives, installed after ``fully_shard``
(:func:`split_config`): ``deltas=1`` (weights sent as differences), ``feedback=1``
(gradients with error feedback), ``state=8|N|32|dtype`` (their state). The default:
``exact``, ``bits=8``, ``ag_bits=4,rs_bits=8``, ``bits=4``, ``bits=4,scheme=nuq``,
``bits=4,ag_rounding=nearest,ag_bucket=128``.

Modes (``--mode``, comma list, each mode runs every variant): ``fsdp2`` (full shard over
all ranks: ``fully_shard`` per block and at the root) and ``hsdp`` (a 2-D mesh
``(replicate, shard)`` = (nodes, ranks per node): shard inside a node, replicate across
nodes, ``fully_shard(..., mesh=mesh)``; the mesh's groups are qcomm groups, so FSDP2's
reduce-scatter and all-gather run on the node's group and the replicate all-reduce on
the group of equal local ranks).

Nodes (qcomm's topology): every rank is told its node (``QCOMM_NODE``); without ``--nodes``
each loopback rank is a node and each ``--link`` host one. ``--nodes 2
--ranks-per-node P --link RATE`` runs two nodes of P ranks, each a network namespace
(ranks of a node unshaped, the nodes over the shaped veth); the default configs are
then ``exact``, ``bits=8,topology=flat`` and ``bits=8,topology=auto``::

    python -m bench train --nodes 2 --ranks-per-node 2 --link 100mbit --mode fsdp2,hsdp

Per run, besides the below: bytes per step that crossed to other nodes and stayed
inside the node (qcomm.stats' ``inter_node_bytes`` / ``intra_node_bytes`` over every
group the run used, averaged over the ranks); the summary's ``vs_flat`` is a
``topology=auto`` config's step time against the same config's with ``topology=flat``.

Behind ``--link`` (a rate, or ``unshaped``: the two namespaces at the veth's speed) each
node's interface is read too (``/sys/class/net/<dev>/statistics/tx_bytes``, after a
barrier, from the end of warm-up to the end): ``iface`` is every byte the hosts sent a
step, TCP/IP framing and ACKs included; ``fewer_bytes``: what exact calls send across
under a direct exchange (qcomm.stats' count of the exact run; gloo's own algorithms send
more, which ``counted/iface`` of exact shows) over a config's ``iface``;
``counted/iface``: what qcomm.stats counted as sent to other nodes (all ranks) over
``iface``, the check that the counters miss nothing::

    python -m bench train --link unshaped --config exact --config bits=8 --config bits=4

Ranks: started here (``--world``, loopback or ``--link``), or torchrun's (``torchrun
--nproc-per-node 2 -m bench train``: every run in those processes, one process group
after another, over the real network; rank 0 prints and writes the results).

Per run: held-out loss every ``--eval-every`` steps, median step time, tokens/s, bytes
on the wire per step (``qcomm.stats``), and the share of the step spent communicating,
``1 - T_compute / T_step``, where ``T_compute`` is the same step (forward, backward,
AdamW) timed on an unsharded local replica on the same cores. FSDP2 on CPU does not
overlap communication with compute, so the best a variant can do is Amdahl's bound
``T_base / (T_compute + T_comm_base / ratio)`` (``ratio``: of the bytes sent to other
nodes where the runs count them, else of the wire bytes); the summary prints each
variant's speedup against it. The bytes FSDP2's own bf16 mixed precision would send are
reported too: half the exact fp32 bytes (both are exact casts, so that is arithmetic, not a
measurement).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import statistics
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import common
from .common import Column
from .link import (
    LinkError,
    ShapedLink,
    add_layout_arguments,
    default_nodes,
    layout_name,
    node_layout,
    parse_link,
    pin_this_rank,
    run_spec,
)

CONFIGS = ("exact", "bits=8", "ag_bits=4,rs_bits=8", "bits=4", "bits=4,scheme=nuq",
           "bits=4,ag_rounding=nearest,ag_bucket=128")  # the default
HELD_OUT = 0.05  # the last 5% of files (sorted order) are the evaluation split
MODES = ("fsdp2", "hsdp")
NODE_CONFIGS = ("exact", "bits=8,topology=flat", "bits=8,topology=auto")  # with --nodes
INIT_SEED = 1234  # every variant and data seed starts from the same weights


# ----------------------------------------------------------------------------- data


def corpus_files(root: str | None = None) -> list[Path]:
    root = Path(root or sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py")
                  if "site-packages" not in p.parts and p.is_file())


def load_corpus(root: str | None = None, limit_bytes: int | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, eval) uint8 tensors: the files' bytes, the last 5% of files held out."""
    files = corpus_files(root)
    if len(files) < 20:
        raise RuntimeError(f"found only {len(files)} .py files under the stdlib; need >= 20")
    cut = len(files) - max(1, int(len(files) * HELD_OUT))
    def read(paths):
        data = bytearray()
        for p in paths:
            data += p.read_bytes()
            if limit_bytes and len(data) >= limit_bytes:
                break
        return torch.frombuffer(data, dtype=torch.uint8).clone()
    return read(files[:cut]), read(files[cut:])


# ---------------------------------------------------------------------------- model


@dataclass(frozen=True)
class GPTConfig:
    layers: int = 4
    width: int = 128
    heads: int = 4
    seq: int = 128
    vocab: int = 256


class Block(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(c.width)
        self.qkv = nn.Linear(c.width, 3 * c.width)
        self.proj = nn.Linear(c.width, c.width)
        self.ln2 = nn.LayerNorm(c.width)
        self.fc = nn.Linear(c.width, 4 * c.width)
        self.out = nn.Linear(4 * c.width, c.width)
        self.heads = c.heads

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.tok = nn.Embedding(c.vocab, c.width)
        self.pos = nn.Embedding(c.seq, c.width)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.layers))
        self.ln = nn.LayerNorm(c.width)
        self.apply(self._init)

    @staticmethod
    def _init(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx, targets):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        logits = self.ln(x) @ self.tok.weight.t()  # tied embedding
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def batch_at(data: torch.Tensor, starts: torch.Tensor, seq: int):
    offs = starts[:, None] + torch.arange(seq + 1)
    chunk = data[offs].long()
    return chunk[:, :-1], chunk[:, 1:]


def lr_at(step: int, steps: int, lr: float, warmup: int) -> float:
    if step < warmup:
        return lr * (step + 1) / warmup
    p = (step - warmup) / max(1, steps - warmup)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p)))


# -------------------------------------------------------------------------- configs


# The bench's own keys: qcomm.fsdp's stateful collectives (options of its API, not
# CommConfig fields), installed after fully_shard; "state" is theirs.
FSDP_KEYS = {"deltas": "quantize_weight_deltas", "feedback": "feed_back_gradient_errors"}


def split_config(text: str) -> tuple[dict[str, str], str]:
    """``"bits=4,deltas=1,state=32"`` -> ``({"deltas": "1", "state": "32"}, "bits=4")``:
    qcomm.fsdp's keys (:data:`FSDP_KEYS`, ``state``), checked, and the rest of the
    config. ValueError naming a bad one."""
    own, rest = {}, []
    for item in text.split(","):
        key, _, value = (t.strip() for t in item.partition("="))
        if key in (*FSDP_KEYS, "state"):
            own[key] = value
        else:
            rest.append(item)
    for key in FSDP_KEYS:
        if own.get(key, "0") not in ("0", "1"):
            raise ValueError(f"bad config {text!r}: {key}={own[key]!r}, expected 0 or 1")
    if "state" in own:
        if "1" not in (own.get(k) for k in FSDP_KEYS):
            raise ValueError(f"bad config {text!r}: state= needs deltas=1 or feedback=1")
        fsdp_state(own["state"])
    return own, ",".join(rest)


def parse_config(text: str) -> tuple[str, dict[str, str]]:
    """``--config``: :func:`common.parse_config` with qcomm.fsdp's keys set aside
    (a config of those alone: the environment's CommConfig)."""
    own, rest = split_config(text)
    return text.strip(), common.parse_config(rest)[1] if rest or not own else {}


def install_stateful(model, spec: str) -> list:
    """Install the qcomm.fsdp collectives config ``spec`` asks for (``deltas=1``,
    ``feedback=1``, with its ``state=``) on ``model``'s FSDP2 modules; returns them."""
    import qcomm.fsdp

    own = split_config(spec)[0]
    kwargs = {"state": fsdp_state(own["state"])} if "state" in own else {}
    return [c for key, fn in FSDP_KEYS.items() if own.get(key) == "1"
            for c in getattr(qcomm.fsdp, fn)(model, **kwargs)]


def fsdp_state(value: str):
    """``state=`` -> the ``state=`` of qcomm.fsdp's collectives: ``32`` fp32, ``dtype``
    the tensors' dtype, ``N`` (1-8) N-bit nearest codes in 128-element buckets (``8`` is
    the default, :data:`qcomm.fsdp.DEFAULT_STATE`)."""
    import qcomm.fsdp

    if value == "32":
        return qcomm.fsdp.STATE_FP32
    if value == "dtype":
        return qcomm.fsdp.STATE_DTYPE
    if not value.isdigit() or not 1 <= int(value) <= 8:
        raise ValueError(f"bad config: state={value!r}, expected 1-8, 32 or dtype")
    return qcomm.fsdp.DEFAULT_STATE.replace(bits=int(value))


# ----------------------------------------------------------------------------- rank


def _time_local_step(cfg: GPTConfig, batch: int, reps: int) -> float:
    """Median seconds of one unsharded forward+backward+AdamW step on this rank's cores."""
    torch.manual_seed(0)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, 256, (batch, cfg.seq))
    times = []
    for _ in range(reps + 1):
        t = time.perf_counter()
        model(x, x).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t)
    return statistics.median(times[1:])


def worker(spec: dict) -> dict:
    """One run on this rank (a process group of its own, from the QCOMM_* environment);
    returns its row, also written for :func:`bench.link.run_spec` when
    ``spec["result"]`` is given."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    import qcomm

    pin_this_rank()
    timeout = datetime.timedelta(seconds=spec["op_timeout"])
    if spec.get("torchrun_run") is None:
        dist.init_process_group("qcomm", timeout=timeout)
    else:
        dist.init_process_group("qcomm", timeout=timeout, store=_torchrun_store(
            spec["torchrun_run"], timeout), rank=int(os.environ["RANK"]),
            world_size=int(os.environ["WORLD_SIZE"]))
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = GPTConfig(**spec["model"])
    train, held = load_corpus(limit_bytes=spec.get("limit_bytes"))
    torch.manual_seed(INIT_SEED)
    model = GPT(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    mesh, groups = None, [dist.group.WORLD]
    if spec.get("mode", "fsdp2") == "hsdp":
        mesh = _hsdp_mesh(spec.get("mesh"), world)
        groups += [mesh.get_group("replicate"), mesh.get_group("shard")]
        groups = list({id(g): g for g in groups}.values())  # a dimension may be WORLD
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    install_stateful(model, spec["name"])
    opt = torch.optim.AdamW(model.parameters(), lr=spec["lr"], weight_decay=0.1,
                            betas=(0.9, 0.95))
    B, T, steps = spec["batch"], cfg.seq, spec["steps"]
    gen = torch.Generator().manual_seed(spec["data_seed"] * 1000 + rank)
    eval_gen = torch.Generator().manual_seed(99)  # the same held-out windows for all runs
    eval_starts = torch.randint(0, held.numel() - T - 1, (spec["eval_windows"],),
                                generator=eval_gen)
    mine = eval_starts[rank::world]

    def evaluate() -> float:
        total = torch.zeros(2, dtype=torch.float64)
        with torch.no_grad():
            for chunk in mine.split(16):
                x, y = batch_at(held, chunk, T)
                total[0] += model(x, y).item() * chunk.numel()
                total[1] += chunk.numel()
        dist.all_reduce(total)  # 2 elements, below min_numel: exact
        return (total[0] / total[1]).item()

    curve, step_times = [], []
    # behind --link every node is a namespace: its interface's bytes are all it sent
    counting = spec["link"] not in ("loopback", "torchrun")
    tx_path = Path(f"/sys/class/net/{os.environ.get('GLOO_SOCKET_IFNAME')}/statistics/tx_bytes")

    def read_stats(reset: bool = False) -> list:
        return [s for g in groups for s in qcomm.stats(g, reset=reset).values()]

    def start_counting() -> int:
        read_stats(reset=True)
        dist.barrier()  # every rank's sends of the steps before have left
        return int(tx_path.read_text()) if counting else 0

    tx = start_counting()
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps, spec["lr"], spec["warmup"])
        x, y = batch_at(train, torch.randint(0, train.numel() - T - 1, (B,), generator=gen), T)
        dist.barrier()
        t = time.perf_counter()
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        step_times.append(time.perf_counter() - t)
        if step == spec["warmup_steps"] - 1:
            tx = start_counting()  # bytes per step counted after warm-up
        if (step + 1) % spec["eval_every"] == 0 or step + 1 == steps:
            curve.append((step + 1, evaluate(), loss.item()))
            if rank == 0:
                print(f"# {spec.get('mode', 'fsdp2')} {spec['name']} seed {spec['data_seed']}: "
                      f"step {step + 1}/{steps} "
                      f"train {loss.item():.4f} eval {curve[-1][1]:.4f} "
                      f"({statistics.median(step_times[-10:]):.3f} s/step)",
                      file=sys.stderr, flush=True)
    stats = read_stats()
    counted = max(1, steps - spec["warmup_steps"])
    wire = sum(s.wire_bytes for s in stats) / counted
    logical = sum(s.logical_bytes for s in stats) / counted
    # by node, averaged over the ranks (without node counters: all as inter)
    by_node = torch.tensor([sum(getattr(s, "intra_node_bytes", 0) for s in stats),
                            sum(getattr(s, "inter_node_bytes", s.wire_bytes) for s in stats)],
                           dtype=torch.float64) / counted
    dist.all_reduce(by_node)  # float64: exact
    intra, inter = (by_node / world).tolist()
    dist.barrier()
    # what each node's interface sent, once a node (its ranks read the same counter)
    every = torch.zeros(world, 2, dtype=torch.float64)  # (node, bytes) a rank
    every[rank] = torch.tensor([float(os.environ.get("GROUP_RANK", rank)),
                                int(tx_path.read_text()) - tx if counting else 0.0])
    dist.all_reduce(every)  # float64, below min_numel: exact
    per_node = {}
    for node, nbytes in every.tolist():
        per_node[node] = max(per_node.get(node, 0.0), nbytes)
    t_compute = _time_local_step(cfg, B, reps=5)  # both ranks at once, as in training
    timed = step_times[spec["warmup_steps"]:] or step_times
    t_step = statistics.median(timed)
    row = {"variant": spec["name"], "data_seed": spec["data_seed"], "params": n_params,
           "final_eval": curve[-1][1], "curve": curve, "step_s": t_step,
           "tokens_per_s": world * B * T / t_step, "compute_s": t_compute,
           "comm_share": max(0.0, 1 - t_compute / t_step), "wire_bytes_per_step": wire,
           "logical_bytes_per_step": logical, "inter_bytes_per_step": inter,
           "intra_bytes_per_step": intra, "mode": spec.get("mode", "fsdp2"), "world": world,
           "iface_bytes_per_step": sum(per_node.values()) / counted if counting else None,
           "layout": spec.get("layout"), "link": spec["link"]}
    decided = [(s.auto_exact, s.auto_compressed) for s in stats]
    if any(e + c for e, c in decided):  # bits=auto: the share of its calls it compressed,
        row["auto_compressed"] = sum(c for _, c in decided) / sum(e + c for e, c in decided)
        # and what measuring its model took (the slowest group), all and the link's part
        models = [m for m in map(qcomm.auto_model, groups) if m is not None]
        row["auto_calibration_s"] = max(m["calibration_s"] for m in models)
        row["auto_link_s"] = max(m["link_calibration_s"] for m in models)
    if spec.get("result"):
        Path(spec["result"] + str(rank)).write_text(json.dumps(row))
    dist.barrier()
    dist.destroy_process_group()
    return row


def _hsdp_mesh(nodes: list[list[int]] | None, world: int):
    """HSDP's ``(replicate, shard)`` mesh: row i the ranks of node i (``nodes``), or under
    torchrun ``(world / LOCAL_WORLD_SIZE, LOCAL_WORLD_SIZE)`` in torchrun's node-major
    order (what ``init_device_mesh("cpu", (N, P), ...)`` builds)."""
    from torch.distributed.device_mesh import DeviceMesh

    if nodes is None:
        per = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        if world % per:
            raise ValueError(f"--mode hsdp: {world} ranks do not split into nodes of {per}")
        nodes = torch.arange(world).view(world // per, per).tolist()
    return DeviceMesh("cpu", torch.tensor(nodes), mesh_dim_names=("replicate", "shard"))


# --------------------------------------------------------------------------- driver


_TORCHRUN_STORE = []  # this process's client of torchrun's store, made once


def _torchrun_store(run: int, timeout):
    """Run ``run``'s own view of torchrun's store. Every run inits and destroys the
    default group in the same processes, and torch names the default group the same each
    time: on one shared store, gloo's rendezvous keys of an earlier run would be read by
    a later one (seen: a run hung connecting to the previous run's closed sockets)."""
    import torch.distributed as dist

    if not _TORCHRUN_STORE:
        agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
        _TORCHRUN_STORE.append(dist.TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
            int(os.environ["WORLD_SIZE"]),
            is_master=not agent and os.environ["RANK"] == "0", timeout=timeout))
    return dist.PrefixStore(f"qcomm-bench-train/{run}", _TORCHRUN_STORE[0])


def under_torchrun() -> bool:
    """Whether this process is one of torchrun's ranks (then every run happens here,
    over torchrun's rendezvous and the real network, one process group per run)."""
    return "TORCHELASTIC_RUN_ID" in os.environ and "RANK" in os.environ


@contextlib.contextmanager
def _environ(changes: dict):
    """``os.environ`` with ``changes`` for the block, then exactly as before."""
    before = {k: os.environ.get(k) for k in changes}
    os.environ.update(changes)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run_variant(args, name: str, env: dict, seed: int, link, mode: str = "fsdp2") -> dict:
    """One run of config ``name`` (``env``: its QCOMM_* variables)."""
    spec = {"name": name, "data_seed": seed, "model": asdict(args.model), "mode": mode,
            "mesh": args.mesh, "layout": args.layout,
            "batch": args.batch, "steps": args.steps, "lr": args.lr,
            "warmup": max(1, args.steps // 20), "warmup_steps": min(5, args.steps - 1),
            "eval_every": args.eval_every, "eval_windows": args.eval_windows,
            "op_timeout": args.op_timeout, "link": args.link_name,
            "limit_bytes": args.limit_bytes}
    env = dict(env, QCOMM_SEED=str(seed))
    if under_torchrun():
        spec["torchrun_run"] = args.runs_started
        args.runs_started += 1
        with _environ(env):
            return worker(spec)
    return run_spec("bench.train", spec, args.world, timeout_s=args.timeout, env=env,
                    link=link, nodes=args.node_of_rank)[0]


def summarize(rows: list[dict]) -> tuple[list[dict], list[str]]:
    """One summary row per mode and variant: means over seeds, paired differences vs the
    mode's exact, auto's ``vs_flat``; with the lines to print."""
    modes = {}
    for r in rows:
        modes.setdefault(r.get("mode", "fsdp2"), []).append(r)
    out, lines = [], []
    for mode, rs in modes.items():
        summary, said = _summarize_mode(rs)
        for s in summary:
            s["mode"] = mode
            flat = next((f for f in summary
                         if f["variant"] == common.flat_twin(s["variant"])), None)
            if flat:
                s["vs_flat"] = flat["step_s"] / s["step_s"]
        out += summary
        lines += [f"# {mode}: {line[2:]}" if len(modes) > 1 else line for line in said]
    return out, lines


def _summarize_mode(rows: list[dict]) -> tuple[list[dict], list[str]]:
    by = {}
    for r in rows:
        by.setdefault(r["variant"], []).append(r)
    base = {r["data_seed"]: r for r in by.get("exact", [])}
    base_step = statistics.median(r["step_s"] for r in base.values()) if base else None
    base_compute = statistics.median(r["compute_s"] for r in base.values()) if base else None
    base_wire = statistics.median(r["wire_bytes_per_step"] for r in base.values()) if base else None
    out, lines = [], []
    for name, rs in by.items():
        finals = [r["final_eval"] for r in rs]
        s = {"variant": name, "runs": len(rs), "final_eval_mean": statistics.fmean(finals),
             "final_eval_sd": statistics.stdev(finals) if len(finals) > 1 else float("nan"),
             "step_s": statistics.median(r["step_s"] for r in rs),
             "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rs),
             "comm_share": statistics.median(r["comm_share"] for r in rs),
             "wire_bytes_per_step": statistics.median(r["wire_bytes_per_step"] for r in rs)}
        s["wire_mb_per_step"] = s["wire_bytes_per_step"] / 1e6
        if any("auto_compressed" in r for r in rs):
            s["auto_compressed"] = statistics.median(r.get("auto_compressed", 0) for r in rs)
            s["auto_calibration_s"] = max(r.get("auto_calibration_s", 0) for r in rs)
            s["auto_link_s"] = max(r.get("auto_link_s", 0) for r in rs)
        for where in ("inter", "intra", "iface"):  # iface: behind a link only
            got = [r[f"{where}_bytes_per_step"] for r in rs
                   if r.get(f"{where}_bytes_per_step") is not None]
            if got:
                s[f"{where}_mb_per_step"] = statistics.median(got) / 1e6
        if "iface_mb_per_step" in s:
            # what qcomm.stats counted as sent to other nodes, all ranks, over what left
            # the hosts' interfaces (TCP/IP framing, ACKs and barriers included)
            s["counted_vs_iface"] = statistics.median(
                r["inter_bytes_per_step"] * r["world"] / r["iface_bytes_per_step"] for r in rs)
            if base:  # what an exact direct exchange sends across (gloo's own sends more)
                exact_sent = statistics.median(r["inter_bytes_per_step"] * r["world"]
                                               for r in base.values())
                s["fewer_bytes"] = exact_sent / (s["iface_mb_per_step"] * 1e6)
        paired = [100 * (r["final_eval"] / base[r["data_seed"]]["final_eval"] - 1)
                  for r in rs if r["data_seed"] in base]
        if paired and name != "exact":
            s["paired_diff_pct"] = statistics.fmean(paired)
            s["paired_se_pct"] = (statistics.stdev(paired) / math.sqrt(len(paired))
                                  if len(paired) > 1 else float("nan"))
            if len(paired) > 1:
                t_crit = T95[min(len(paired) - 1, len(T95)) - 1]
                s["significant_95"] = abs(s["paired_diff_pct"]) > t_crit * s["paired_se_pct"]
        if base_step:
            s["speedup"] = base_step / s["step_s"]
            # the bytes that cross to other nodes where known (two-level sends exact
            # inside the node: its wire bytes overstate what meets the slow link)
            key = "inter_mb_per_step" if "inter_mb_per_step" in s else "wire_mb_per_step"
            sent = s[key] * 1e6
            base_sent = statistics.median(r.get(key.replace("_mb_", "_bytes_"), 0)
                                          for r in base.values())
            ratio = base_sent / sent if sent and base_sent else 1.0
            comm_base = base_step - base_compute
            s["amdahl_bound"] = base_step / (base_compute + comm_base / ratio)
            s["of_bound"] = s["speedup"] / s["amdahl_bound"]
        out.append(s)
    if base_wire:
        lines.append(f"# exact bytes on the wire per step: {base_wire / 1e6:.2f} MB; FSDP2 bf16 "
                     f"mixed precision would send half: {base_wire / 2e6:.2f} MB")
    return out, lines


# Two-sided 95% Student t critical values for 1..10 degrees of freedom (then ~normal).
T95 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228)

SUMMARY_COLUMNS = [
    Column("mode", "mode"), Column("variant", "variant"), Column("runs", "runs"),
    Column("final_eval_mean", "eval_loss", "{:.4f}"), Column("final_eval_sd", "sd", "{:.4f}"),
    Column("paired_diff_pct", "vs_exact_%", "{:+.2f}"), Column("paired_se_pct", "se_%", "{:.2f}"),
    Column("significant_95", "sig95"),
    Column("step_s", "step_s", "{:.3f}"), Column("tokens_per_s", "tok/s", "{:.0f}"),
    Column("comm_share", "comm", "{:.0%}"),
    Column("wire_mb_per_step", "wire_MB", "{:.3f}"),
    Column("inter_mb_per_step", "inter_MB", "{:.3f}"),
    Column("intra_mb_per_step", "intra_MB", "{:.3f}"),
    Column("iface_mb_per_step", "iface_MB", "{:.3f}"),
    Column("fewer_bytes", "fewer_bytes", "{:.2f}x"),
    Column("counted_vs_iface", "counted/iface", "{:.3f}"),
    Column("vs_flat", "vs_flat", "{:.2f}"),
    Column("auto_compressed", "auto_compr", "{:.0%}"),
    Column("auto_calibration_s", "auto_cal_s", "{:.2f}"),
    Column("auto_link_s", "of_it_link_s", "{:.2f}"),
    Column("speedup", "speedup", "{:.2f}"), Column("amdahl_bound", "bound", "{:.2f}"),
    Column("of_bound", "of_bound", "{:.0%}"),
]


def plot(folder: Path, stem: str, rows: list[dict], summary: list[dict]) -> Path | None:
    if not common.have_matplotlib():
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_node = any("inter_mb_per_step" in s for s in summary)
    fig, (a, *bars) = plt.subplots(1, 3 if by_node else 2, figsize=(18 if by_node else 12, 5))
    colors = plt.get_cmap("tab20").colors
    several = len({s.get("mode", "fsdp2") for s in summary}) > 1
    names = [f"{s['mode']} {s['variant']}" if several else s["variant"] for s in summary]
    for i, s in enumerate(summary):  # one line per mode and variant: the mean over seeds
        runs = [r for r in rows if r["variant"] == s["variant"]
                and r.get("mode", "fsdp2") == s.get("mode", "fsdp2")]
        steps = [c[0] for c in runs[0]["curve"]]
        mean = [statistics.fmean(r["curve"][k][1] for r in runs) for k in range(len(steps))]
        a.plot(steps, mean, linewidth=1.2, color=colors[i % len(colors)],
               linestyle="-" if i < len(colors) else "--",
               label=f"{names[i]} (n={len(runs)})")
    a.set_xlabel("step")
    a.set_ylabel("held-out loss (nats/byte), mean over seeds")
    a.grid(True, alpha=0.3)
    a.legend(fontsize=7)
    panels = [("step_s", "median step time (s)"),
              ("inter_mb_per_step", "bytes to other nodes per step and rank (MB)")]
    for ax, (key, label) in zip(bars, panels, strict=False):
        ax.bar(names, [s.get(key, 0) for s in summary])
        ax.set_ylabel(label)
        ax.set_xticks(range(len(names)), names, rotation=40, ha="right", fontsize=8)
    fig.tight_layout()
    path = folder / f"{stem}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def parse_ints(text: str) -> list[int]:
    return [int(t) for t in text.split(",") if t.strip()]


def add_arguments(p: argparse.ArgumentParser, on_gpu: bool) -> None:
    p.add_argument("--config", action="append", type=common.arg(parse_config),
                   metavar="SPEC", help="one variant, repeatable: exact (the baseline) or "
                   "qcomm's keys, plus deltas=1, feedback=1, state=8|N|32|dtype, e.g. "
                   "bits=4,scheme=nuq,deltas=1 (default: see above)")
    p.add_argument("--mode", type=common.arg(lambda s: common.parse_list(s, MODES, "--mode")),
                   default=["fsdp2"],
                   help="comma list: fsdp2 (full shard over all ranks), hsdp (replicate "
                        "across nodes, shard inside a node)")
    p.add_argument("--seeds", type=common.arg(parse_ints), default=[0],
                   help="data-order seeds (comma list); each variant runs every seed")
    p.add_argument("--tag", default="", help="a suffix of the results' file names "
                   "(NAME-TAG.json): a run beside another of the same link and layout")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--eval-windows", type=int, default=128)
    p.add_argument("--world", type=int, default=None,
                   help="ranks (default 2; with --nodes: nodes x ranks per node)")
    p.add_argument("--link", type=common.arg(parse_link), default=None,
                   help="link rate (100mbit, 1gbit) or 'unshaped': the ranks as two hosts "
                        "(network namespaces, needs root) behind it, each host's interface "
                        "counted")
    add_layout_arguments(p)
    p.add_argument("--limit-bytes", type=int, default=None,
                   help="read only this many training bytes (tests)")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per run, all in")
    p.add_argument("--op-timeout", type=float, default=600)


def resolve(args) -> str | None:
    """Fill in the layout (``args.node_of_rank``, ``args.mesh``: HSDP's rows of ranks by
    node), world and configs; the error text of a bad combination, else None."""
    try:
        args.node_of_rank = node_layout(args.nodes, args.ranks_per_node, args.world,
                                        args.rank_order, link=args.link is not None)
    except ValueError as err:
        return str(err)
    args.layout = layout_name(args.node_of_rank)
    if args.config is None:
        args.config = [parse_config(c) for c in (NODE_CONFIGS if args.node_of_rank
                                                 else CONFIGS)]
    if under_torchrun():
        if args.link or args.node_of_rank:
            return ("under torchrun the nodes and the link are torchrun's (real hosts and "
                    "network); drop --link and --nodes")
        args.world, args.link_name, args.mesh = int(os.environ["WORLD_SIZE"]), "torchrun", None
        return None
    if args.node_of_rank is not None:
        args.world = len(args.node_of_rank)
    args.world = args.world or 2
    nodes = args.node_of_rank or default_nodes(args.world, args.link is not None)
    args.mesh = [[r for r, n in enumerate(nodes) if n == node] for node in sorted(set(nodes))]
    if "hsdp" in args.mode and len({len(row) for row in args.mesh}) > 1:
        return (f"--mode hsdp needs nodes of equal size, got {[len(r) for r in args.mesh]} "
                "ranks: use --nodes N --ranks-per-node P")
    return None


def main(args) -> int:
    args.model = GPTConfig(args.layers, args.width, args.heads, args.seq)
    args.link_name = args.link or "loopback"
    lead = True  # the process that prints and writes the results
    args.runs_started = 0
    error = resolve(args)
    if error:
        print(f"python -m bench train: {error}", file=sys.stderr)
        return 2
    if under_torchrun():
        lead = os.environ["RANK"] == "0"
    with contextlib.ExitStack() as stack:
        if not lead:  # the other ranks run the same steps silently
            stack.enter_context(contextlib.redirect_stdout(
                stack.enter_context(open(os.devnull, "w"))))
        return _main(args, lead)


def _main(args, lead: bool) -> int:
    header = common.run_header("train", device="cpu (gloo)", link=args.link_name,
                               command=args.command)
    header["train"] = {"model": asdict(args.model), "batch": args.batch, "steps": args.steps,
                       "lr": args.lr, "world": args.world, "seeds": args.seeds,
                       "configs": [name for name, _ in args.config], "modes": args.mode}
    header["layout"], header["mesh"] = args.layout, args.mesh  # mesh: ranks by node
    print(common.format_header(header), flush=True)
    rows = []
    try:
        with ShapedLink(args.link) if args.link else contextlib.nullcontext() as link:
            for seed in args.seeds:
                for mode in args.mode:
                    for name, env in args.config:
                        rows.append(run_variant(args, name, env, seed, link, mode))
    except LinkError as err:
        print(f"python -m bench train: {err}", file=sys.stderr)
        return 2
    if not lead:
        return 0
    summary, lines = summarize(rows)
    folder = common.results_dir(args.out, header)
    stem = (f"train-{args.link_name}" + (f"-{args.layout}" if args.layout else "")
            + (f"-{args.tag}" if args.tag else ""))
    print(common.format_table(SUMMARY_COLUMNS, summary))
    for line in lines:
        print(line)
    common.write_results(folder, stem, header, SUMMARY_COLUMNS, summary)
    (folder / f"{stem}-runs.json").write_text(json.dumps({"header": header, "runs": rows},
                                                         indent=1) + "\n")
    print(f"# wrote {folder}/{stem}.json, .csv, -runs.json", file=sys.stderr)
    if not args.no_plot and plot(folder, stem, rows, summary):
        print(f"# wrote {folder}/{stem}.png", file=sys.stderr)
    return 0


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--worker":
    worker(json.loads(Path(sys.argv[2]).read_text()))
