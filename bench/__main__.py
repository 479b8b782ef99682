"""``python -m bench <what> [options]``: one entry point for every benchmark.

    python -m bench codec                       # quantize/dequantize vs memcpy
    python -m bench collectives                 # ranks on loopback (self-launched)
    python -m bench collectives --link 1gbit    # two namespaces behind a shaped link
    python -m bench collectives --config exact --config bits=4,scheme=nuq
                                                # variants in qcomm's config keys (QCOMM_*)
    python -m bench collectives --link 100mbit --overlap
                                                # async_op=True behind compute
    python -m bench train                       # FSDP2 training, exact vs quantized
    python -m bench train --link unshaped       # two hosts: the bytes each interface sent
    python -m bench memory                      # peak RSS: FSDP2 vs qcomm.fsdp's state
    python -m bench breakeven                   # W ranks simulated: codec calls, launches,
                                                # and where compression pays
    python -m bench soak                        # 10,000 mixed collectives, every result checked
    python -m bench auto-choices                # bits=auto's choices on an H200, from its
                                                # measured codec costs
    python -m bench report                      # docs/results.md and README's results

Nodes (qcomm's topology): every self-launched rank is told its node (QCOMM_NODE);
without --nodes each loopback rank is a node of its own and each --link namespace one.

    python -m bench collectives --nodes 2 --ranks-per-node 2 --link 100mbit
        # 2 nodes x 2 ranks, a namespace per node: exact, bits=8,topology=flat, bits=8,topology=auto
    python -m bench train --nodes 2 --ranks-per-node 2 --link 100mbit --mode fsdp2,hsdp
        # FSDP2 full shard and HSDP on 2 x 2: the same three configs
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from . import (
    auto_choices,
    breakeven,
    codec,
    collectives,
    common,
    memory,
    report,
    soak,
    train,
)


def parser() -> argparse.ArgumentParser:
    on_gpu = torch.cuda.is_available()
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="what", required=True)
    for name, module in (("codec", codec), ("collectives", collectives), ("train", train),
                         ("memory", memory), ("breakeven", breakeven), ("soak", soak)):
        summary = " ".join(module.__doc__.split("\n\n")[0].split()).split(": ", 1)[-1]
        q = sub.add_parser(name, help=summary,
                           description=module.__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(q, on_gpu)
        q.add_argument("--out", default=None,
                       help="results folder (default bench/results/<machine>/)")
        q.add_argument("--no-plot", action="store_true", help="skip the PNG plots")
        q.set_defaults(main=module.main)
    # prints a table: no files, no plots
    q = sub.add_parser("auto-choices", help="bits=auto's choices on an H200, from its codec",
                       description=auto_choices.__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    auto_choices.add_arguments(q)
    q.set_defaults(main=auto_choices.main, no_plot=True)
    q = sub.add_parser("report", help="regenerate docs/results.md and README's results lines",
                       description=report.__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    report.add_arguments(q)
    q.set_defaults(main=report.main, no_plot=True)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parser().parse_args(argv)
    args.command = " ".join(["python", "-m", "bench", *argv])  # the run header's record
    rc = args.main(args)
    lead = os.environ.get("RANK", "0") == "0"  # under torchrun, rank 0 writes the files
    if rc == 0 and lead and not args.no_plot and not common.have_matplotlib():
        # the README's set-up installs the [test] extra, which has no matplotlib
        print("# PNG plots skipped: matplotlib is not installed "
              "(pip install -e '.[plot]' to get them); JSON and CSV were written",
              file=sys.stderr)
    return rc


if __name__ == "__main__":
    sys.exit(main())
