"""FSDP2 on the "qcomm" backend next to plain gloo: bytes on the wire and loss.

Run ``python -m qcomm.demo`` (it launches 2 CPU processes itself) or
``torchrun --nproc-per-node 2 -m qcomm.demo``. Each process trains the same small
transformer twice with ``fully_shard``, each rank on its own data: once over a plain
gloo group, once over qcomm (8-bit all-gathers and reduce-scatters by default; the
``QCOMM_*`` variables apply). Rank 0 prints the two loss curves side by side and,
per collective, the bytes this rank sent compressed against what gloo would send, then
what the run showed and what to run next: on loopback the bytes saved cost nothing to
send, so the wall time shows the codec's cost, not compression's gain; the shaped-link
benchmarks (``python -m bench collectives --link 100mbit``, ``python -m bench train
--link 100mbit``) show the gain. Then the same training once more with ``bits=auto``
(:mod:`qcomm.auto`: each call exact or compressed, whichever a model measured on this
link and codec predicts faster), and what it chose. Step times are compared last, once
every variant has run (the first run of anything in a process pays its set-up), the
variants interleaved round by round.

Launched here, each process plays one host (``QCOMM_NODE=host<rank>``): under the
default ``QCOMM_TOPOLOGY=auto`` ranks of one node send exact, and on one machine every
rank is on one node. Under torchrun the real nodes count.

The codec runs eagerly here (``QCOMM_COMPILE=0`` unless set, read into the group's
config when it is created: ``torch.compile`` costs ~25 s per process before the first
step, the same bytes either way).
"""

from __future__ import annotations

import argparse
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.nn as nn

VOCAB, DIM, SEQ, BATCH = 64, 64, 16, 8


class TinyLM(nn.Module):
    """Embedding, ``layers`` pre-norm-free transformer encoder layers, a vocab head."""

    def __init__(self, dim: int = DIM, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(dim, 4, 2 * dim, dropout=0.0, batch_first=True)
            for _ in range(layers)
        )
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h)
        # A Linear over [B, T, C] returns a view, which FSDP2 warns about (an in-place op
        # on it would skip a hook); clone so the root module returns a tensor of its own.
        return self.head(h).clone()


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank- and step-specific tokens and their targets under a learnable map."""
    g = torch.Generator().manual_seed(10_000 * rank + step)
    x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return x, (3 * x + 1) % VOCAB


def train_fsdp2(mesh, steps: int, dim: int, times: list | None = None) -> list[float]:
    """Train a fresh TinyLM (same init on every rank and run) sharded over ``mesh``
    (``times``: gets each step's seconds)."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = TinyLM(dim)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return train(model, dist.get_rank(), steps, times=times)


def train(model: nn.Module, rank: int, steps: int, lr: float = 3e-3,
          times: list | None = None) -> list[float]:
    """``steps`` Adam steps of ``model`` (a TinyLM, wrapped any way) on ``rank``'s
    batches, on the model's device (tokens and targets both); the losses (``times``:
    gets each step's seconds)."""
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    device = next(model.parameters()).device
    losses = []
    for step in range(steps):
        began = time.perf_counter()
        x, y = (t.to(device) for t in batch(rank, step))
        loss = nn.functional.cross_entropy(model(x).view(-1, VOCAB), y.view(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if times is not None:
            times.append(time.perf_counter() - began)
    return losses


def step_times(meshes: dict, dim: int, steps: int = 12, rounds: int = 2) -> dict:
    """Each variant's median step time (``meshes``: name -> mesh), measured fairly:
    after every variant has trained once already (warm: the first run of anything in a
    process pays its set-up), ``rounds`` rounds of ``steps`` steps each, the variants
    interleaved round by round (a busy machine slows them alike), a run's first step
    left out."""
    times: dict = {name: [] for name in meshes}
    for _ in range(rounds):
        for name, mesh in meshes.items():
            got: list = []
            train_fsdp2(mesh, steps, dim, times=got)
            times[name] += got[1:]
    got = {name: sorted(t)[len(t) // 2] for name, t in times.items()}
    got["steps"] = rounds * (steps - 1)
    return got


def _run(steps: int, dim: int) -> None:
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    import qcomm

    from .stats import format_table

    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    gloo = dist.new_group(backend="gloo")
    meshes = {"gloo": DeviceMesh.from_group(gloo, "cpu"),
              "qcomm": init_device_mesh("cpu", (world,))}
    base = train_fsdp2(meshes["gloo"], steps, dim)
    qcomm.stats(reset=True)
    ours = train_fsdp2(meshes["qcomm"], steps, dim)
    snap = qcomm.stats()
    cfg = dist.group.WORLD.config
    # bits=auto: the same config, each call exact or compressed by what this link costs
    auto_group = qcomm.wrap(dist.group.WORLD, cfg.replace(auto=True))
    meshes["bits=auto"] = DeviceMesh.from_group(auto_group, "cpu")
    train_fsdp2(meshes["bits=auto"], steps, dim)
    auto = qcomm.stats(auto_group)
    step = step_times(meshes, dim, steps=max(3, min(steps, 12)))  # every variant warm now
    if rank != 0:
        return
    bits = {k: (getattr(cfg, k).bits if getattr(cfg, k) else "off")
            for k in ("all_gather", "reduce_scatter")}
    params = sum(p.numel() for p in TinyLM(dim).parameters())
    print(f"qcomm {qcomm.__version__} demo: FSDP2 fully_shard, {world} CPU ranks, "
          f"TinyLM {params / 1e3:.0f}k params, {steps} steps, torch {torch.__version__}")
    print(f"all-gather {bits['all_gather']}-bit, reduce-scatter {bits['reduce_scatter']}-bit, "
          f"bucket {(cfg.all_gather or cfg.reduce_scatter).bucket_size}, "
          f"min_numel {cfg.min_numel}\n")
    print(f"{'step':>4}  {'loss gloo':>10}  {'loss qcomm':>10}  {'diff':>8}")
    for i, (a, b) in enumerate(zip(base, ours, strict=True)):
        if i % max(1, steps // 10) == 0 or i == steps - 1:
            print(f"{i:>4}  {a:>10.4f}  {b:>10.4f}  {100 * (b - a) / a:>+7.2f}%")
    print("\nbytes rank 0 sent to its peers in the qcomm run:")
    print(format_table(snap))
    print(_what_it_showed(snap, base, ours, step, cfg))
    print(_what_auto_chose(auto, step))


def _what_it_showed(snap, base: list[float], ours: list[float], step: dict, cfg) -> str:
    """The closing lines: what the run showed, why loopback is not faster, what next
    (``cfg``: the qcomm group's CommConfig)."""
    names = {"all_gather": "all-gathers (weights)", "reduce_scatter":
             "reduce-scatters (gradients)", "all_reduce": "all-reduces"}
    cut = [f"{names[k]} {s.ratio:.2f}x" for k, s in snap.items() if s.calls_compressed]
    gap = max(abs(b - a) / abs(a) for a, b in zip(base, ours, strict=True))
    codec = "runs eagerly here, QCOMM_COMPILE=0" if not cfg.compiles() else "is compiled here"
    # against the same calls sent exact, peer to peer (gloo's own algorithms send more)
    shown = ("  fewer bytes on the wire than the same calls sent exact:\n    "
             f"{', '.join(cut)};" if cut
             else "  nothing was compressed (every QCOMM_*_BITS is off?);")
    return "\n".join([
        "\nWhat this run showed:",
        shown,
        f"  {'the same loss' if gap < 0.02 else 'the loss'}: qcomm's curve stays within "
        f"{100 * gap:.2f}% of gloo's at every step",
        f"    ({len(base)} steps, the same model, data and seeds).",
        "Step time on loopback, every variant warm and the variants interleaved (median "
        f"of {step['steps']} steps each):\n  gloo {1e3 * step['gloo']:.1f} ms, qcomm "
        f"{1e3 * step['qcomm']:.1f} ms ({step['gloo'] / step['qcomm']:.2f}x gloo's speed), "
        f"bits=auto {1e3 * step['bits=auto']:.1f} ms "
        f"({step['gloo'] / step['bits=auto']:.2f}x).",
        "What they mean:",
        "  Loopback has no slow link: the bytes saved cost next to nothing to send, while",
        "  quantizing and decoding them costs CPU time",
        f"  (the codec {codec}): the gap, either way, is the codec's cost (and bits=auto's",
        "  agreement of every call) and this machine's noise, not compression's gain.",
        "  Compression pays where the link is the bottleneck. To see it pay, run the ranks as",
        "  two hosts behind a tc-shaped 100 Mbit/s link (network namespaces; needs root):",
        f"    {_python()} -m bench collectives --link 100mbit   # each collective vs exact gloo",
        f"    {_python()} -m bench train --link 100mbit         # FSDP2 training: step time, loss",
        f"    {_python()} -m bench train --link unshaped        # bytes each host's interface sent",
        "  Figures measured so far, with their commands: docs/results.md",
    ])


def _python() -> str:
    """This interpreter as a command to type: ``.venv/bin/python`` where the README's
    set-up made it (``python -m bench`` needs the torch this one has)."""
    import sys

    path = os.path.relpath(sys.executable)
    return path if not path.startswith("..") else sys.executable


def _what_auto_chose(snap, step: dict) -> str:
    """What bits=auto chose on this link, and why (its predicted times a call)."""
    lines = [f"\nbits=auto on this link (each call exact or compressed, whichever its model "
             f"of this link\nand codec predicts faster): a step {1e3 * step['bits=auto']:.1f} "
             f"ms, gloo's {1e3 * step['gloo']:.1f} ms; its first run:"]
    for kind, s in snap.items():
        calls = s.auto_exact + s.auto_compressed
        if calls:
            lines.append(
                f"  auto {kind + ':':<16}{s.auto_exact:>4} exact, {s.auto_compressed:>4} "
                "compressed; "
                f"predicted a call: exact {1e3 * s.predicted_exact_s / calls:.2f} ms, "
                f"compressed {1e3 * s.predicted_compressed_s / calls:.2f} ms")
    return "\n".join(lines)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawned(rank: int, world: int, port: int, steps: int, dim: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world))
    # Each process plays one host: ranks that share a node send exact by default
    # (qcomm.topology), and on one machine every rank would.
    os.environ.setdefault("QCOMM_NODE", f"host{rank}")
    _main_in_rank(steps, dim)


def _main_in_rank(steps: int, dim: int) -> None:
    import qcomm  # noqa: F401  (registers the backend)

    dist.init_process_group("qcomm")
    try:
        _run(steps, dim)
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m qcomm.demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2, help="processes to launch (2)")
    parser.add_argument("--steps", type=int, default=30, help="training steps per run (30)")
    parser.add_argument("--dim", type=int, default=128, help="model width (128)")
    args = parser.parse_args(argv)
    os.environ.setdefault("QCOMM_COMPILE", "0")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if "RANK" in os.environ:  # under torchrun
        _main_in_rank(args.steps, args.dim)
        return
    import torch.multiprocessing as mp

    mp.spawn(_spawned, args=(args.nproc, _free_port(), args.steps, args.dim),
             nprocs=args.nproc)


if __name__ == "__main__":
    main()
