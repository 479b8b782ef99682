"""How correlated the stochastic-rounding errors of one bucket are, for the codec's
uniforms (``uniform`` of the tuned torch path, ``qcomm/cpu/common.py``) against
independent uniforms: the largest eigenvalue of the error covariance over SEEDS seeds,
and the mean squared error per element (the same for all: 1/4 at most, what the
variance bounds use).

    rounding_covariance.py [SEEDS] [B]        default 2000 seeds, bucket 1024

In a tree whose uniforms come from a dither table moved per GROUP of elements (the
dropped experiment of docs/cpu-path.md: ``dither-groups.diff`` of commit 48fe7cb,
written against the ``qcomm.reference`` module of that time, which the import below
replaces), it also measures GROUP sizes 8, 16, 64 and B/2 (one shift per bucket half).

Errors ``1[u >= 1 - f] - f`` of fixed fractions f ~ U(0, 1) (a bucket's level
positions). Independent rounding has a largest eigenvalue of at most 1/4; the
measured one carries sampling noise of about (1 + sqrt(B / SEEDS))^2 / 4.
"""

import sys

import torch

from qcomm.constants import seed_key
from qcomm.cpu import common as R


def main(seeds: int = 2000, B: int = 1024) -> None:
    f = torch.rand(B, generator=torch.Generator().manual_seed(0))
    idx = torch.arange(B, dtype=torch.int32)
    print(f"bucket {B}, {seeds} seeds: largest eigenvalue of the error covariance, "
          "mean squared error per element")
    groups = (8, 16, 64, B // 2) if hasattr(R, "GROUP") else ("codec",)
    for group in ("independent", *groups):
        if group == "independent":
            g = torch.Generator().manual_seed(1)
            u = torch.rand(seeds, B, generator=g)
        else:
            saved = getattr(R, "GROUP", None)
            if saved is not None:
                R.GROUP = group
            u = torch.stack([R.uniform(idx, seed_key(s), B) for s in range(seeds)])
            if saved is not None:
                R.GROUP = saved
        e = (u >= 1 - f).double() - f.double()
        top = torch.linalg.eigvalsh(e.T @ e / seeds)[-1].item()
        print(f"  group {group!s:>11}: {top:7.2f}   {e.square().mean():.4f}")


if __name__ == "__main__":
    main(*map(int, sys.argv[1:]))
