"""The descriptor's envelope both ways, in alternating rounds of one run: small compressed
calls whose payloads ride in the descriptor exchange (one exchange a call, the default)
against the same calls with the envelope shut (``qcomm.handshake.ENVELOPE_ROOM_MAX = 0``:
the descriptor exchange, then the payload exchange) and with no descriptor check at all
(the floor: one exchange, unchecked; not a mode qcomm offers). 2 ranks on loopback, one
core each, 1 thread, 8-bit min-max, all-gather and reduce-scatter of 2^10-2^16 elements;
rank 0's median of 60 calls x ROUNDS per mode.

    python bench/experiments/envelope_toggle.py [ROUNDS]     (from the repository root)
"""

import functools
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def rank_main(rounds: int) -> None:
    sys.path.insert(0, str(ROOT))
    from bench.link import pin_this_rank

    pin_this_rank()
    import torch
    import torch.distributed as dist

    import qcomm
    import qcomm.handshake as H

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    q = qcomm.QuantConfig(bits=8)
    g = qcomm.wrap(dist.group.WORLD, qcomm.CommConfig(all_gather=q, reduce_scatter=q,
                                                      topology="flat"))
    real_check, room = H.start_descriptor_check, H.ENVELOPE_ROOM_MAX

    def mode(name: str) -> None:
        H.ENVELOPE_ROOM_MAX = 0 if name == "two_exchanges" else room
        H.start_descriptor_check = (lambda *a, **k: None) if name == "unchecked" else real_check

    modes = ("envelope", "two_exchanges", "unchecked")
    for log2 in (10, 12, 14, 16):
        n = 1 << log2
        x, big = torch.randn(n), torch.randn(world * n)
        out, part = torch.empty(world * n), torch.empty(n)
        for coll in ("all_gather", "reduce_scatter"):
            if coll == "all_gather":
                call = functools.partial(dist.all_gather_into_tensor, out, x, group=g)
            else:
                call = functools.partial(dist.reduce_scatter_tensor, part, big, group=g)
            times = {m: [] for m in modes}
            for r in range(rounds):
                for m in modes[r % 3:] + modes[:r % 3]:
                    mode(m)
                    for _ in range(10):  # the envelope's room settles on this shape
                        call()
                    for _ in range(60):
                        t = time.perf_counter()
                        call()
                        times[m].append(time.perf_counter() - t)
            mode("envelope")
            if rank == 0:
                row = {"collective": coll, "log2": log2,
                       **{f"{m}_us": round(1e6 * statistics.median(v)) for m, v in times.items()}}
                row["envelope_vs_two"] = round(row["envelope_us"] / row["two_exchanges_us"], 3)
                print(json.dumps(row), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    if os.environ.get("RANK") is not None:
        rank_main(int(sys.argv[1]) if len(sys.argv) > 1 else 6)
        return 0
    sys.path.insert(0, str(ROOT))
    from bench.common import machine_name, run_header
    from bench.link import run_on

    header = run_header("envelope_toggle", device="cpu", command=" ".join(sys.argv))
    print(json.dumps({"machine": machine_name(header),
                      "qcomm_git": header["versions"]["qcomm_git"]}), flush=True)
    run_on("loopback", [__file__, *sys.argv[1:]], env={"PYTHONPATH": str(ROOT)}, timeout_s=900)
    return 0


if __name__ == "__main__":
    sys.exit(main())
