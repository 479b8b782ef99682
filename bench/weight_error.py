"""``python -m bench.weight_error``: which parameters a weight quantizer hurts, and why.

FSDP2 all-gathers one flat buffer per parameter group: rank r's shard of every
parameter of a block, back to back. qcomm buckets that buffer without knowing where
one parameter ends, so a bucket can hold two parameters of very different scale (a
LayerNorm gain near 1.0 beside its bias near 0.0), and the small one is then quantized
with the large one's step. This prints, per parameter of one block of the
``bench train`` model, the relative error ``|q(w) - w| / |w|`` of its slice of rank 0's
all-gather input, for each bucket size, and for buckets aligned to parameter
boundaries (each parameter quantized on its own) as the reference point.

    python -m bench.weight_error [--bits 4] [--buckets 1024,128,64,32] [--rounding nearest]

The weights are the model's initialization with LayerNorm gains and all biases moved
off their initial constants (gains N(1, 0.1), biases N(0, 0.02)), roughly where
training takes them; deterministic (seed 0).
"""

from __future__ import annotations

import argparse
import sys

import torch

import qcomm
from qcomm import QuantConfig

from .train import GPT, GPTConfig


def block_shards(world: int = 2, rank: int = 0) -> list[tuple[str, torch.Tensor]]:
    """(name, rank's flat shard) of each parameter of block 0, in FSDP2's order."""
    torch.manual_seed(0)
    model = GPT(GPTConfig())
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.02)
            elif ".ln" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return [(n, p.detach().chunk(world, dim=0)[rank].reshape(-1).clone())
            for n, p in model.blocks[0].named_parameters()]


def relative_errors(shards, config: QuantConfig, aligned: bool) -> list[float]:
    """Per-parameter relative error of the quantized flat buffer (or of each parameter
    quantized on its own when ``aligned``)."""
    def roundtrip(x):
        return qcomm.dequantize(qcomm.quantize(x, config, impl="eager"), impl="eager")

    if aligned:
        return [float((roundtrip(s) - s).norm() / s.norm()) for _, s in shards]
    flat = torch.cat([s for _, s in shards])
    y, errs, off = roundtrip(flat), [], 0
    for _, s in shards:
        errs.append(float((y[off:off + s.numel()] - s).norm() / s.norm()))
        off += s.numel()
    return errs


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.weight_error", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--buckets", default="1024,128,64,32")
    p.add_argument("--rounding", default="nearest", choices=["nearest", "stochastic"])
    p.add_argument("--scheme", default="minmax", choices=["minmax", "maxnorm", "nuq"])
    args = p.parse_args(argv)
    shards = block_shards()
    rows = [(f"bucket {b}", QuantConfig(bits=args.bits, bucket_size=b, scheme=args.scheme,
                                        rounding=args.rounding), False)
            for b in (int(t) for t in args.buckets.split(","))]
    rows.append(("per-param 128", QuantConfig(bits=args.bits, bucket_size=128,
                                              scheme=args.scheme, rounding=args.rounding),
                 True))
    names = [n for n, _ in shards]
    width = max(len(n) for n in names)
    print(f"# relative error of block 0's all-gather input, {args.bits}-bit {args.scheme} "
          f"{args.rounding}; shard sizes " + ", ".join(f"{n} {s.numel()}" for n, s in shards))
    print(f"{'parameter':<{width}}  " + "  ".join(f"{label:>13}" for label, _, _ in rows))
    table = [relative_errors(shards, cfg, aligned) for _, cfg, aligned in rows]
    for i, name in enumerate(names):
        print(f"{name:<{width}}  " + "  ".join(f"{col[i]:>13.3f}" for col in table))
    ratios = [4 * sum(s.numel() for _, s in shards)
              / qcomm.packed_nbytes(sum(s.numel() for _, s in shards), cfg)
              for _, cfg, _ in rows]
    print(f"{'wire ratio':<{width}}  " + "  ".join(f"{r:>12.2f}x" for r in ratios))
    return 0


if __name__ == "__main__":
    sys.exit(main())
