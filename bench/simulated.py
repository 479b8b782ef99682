"""W ranks in one process: an inner group whose peers are simulated.

:class:`SimulatedPeers` stands for the inner group of rank ``rank`` of ``world``: every
exchange completes at once, in this process, each peer's contribution a copy of what
this rank sends (an all-gather's every row is this rank's payload; in an all-to-all,
peer j "sends" this rank what this rank sends peer j). The payloads are real, their
headers right, so qcomm runs its whole compressed call (codec, descriptors, header
checks, decode of W rows) as at world W, on CPU or CUDA tensors, with one device: what
one rank's call costs at W = 8 or 64 where only one GPU (or one core) is at hand. The
bytes are meaningless as values; what it measures is time and launches.

The copies that stand in for the network are timed apart (:attr:`SimulatedPeers.seconds`)
so a caller can subtract them: a real transfer's bytes go by the NIC, not these copies.

    group = simulated_group(8, device)              # a qcomm group over 8 simulated ranks
    qcomm.all_gather_into_tensor(out, shard, group)
"""

from __future__ import annotations

import time

import qcomm
from qcomm import inner as I


class SimulatedPeers:
    """A duck-typed inner group of ``world`` ranks, this one ``rank``, peers simulated."""

    def __init__(self, world: int, rank: int = 0) -> None:
        if world < 2 or not 0 <= rank < world:
            raise ValueError(f"SimulatedPeers: need world >= 2 and 0 <= rank < world, got "
                             f"world {world}, rank {rank}")
        self._world, self._rank = world, rank
        self.seconds = 0.0  # spent in the copies that stand in for the network
        self.calls = 0

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._world

    def _timed(self, fn):
        start = time.perf_counter()
        fn()
        self.seconds += time.perf_counter() - start
        self.calls += 1
        return I.completed_work()

    def all_gather_single(self, out, inp, opts=None):
        flat = inp.reshape(-1)
        return self._timed(lambda: out.view(self._world, -1).copy_(
            flat.expand(self._world, -1)))

    _allgather_base = all_gather_single

    def all_to_all_single(self, out, inp, out_splits=None, in_splits=None, opts=None):
        if in_splits or out_splits:
            raise ValueError("SimulatedPeers: only even all-to-alls")
        return self._timed(lambda: out.copy_(inp))

    alltoall_base = all_to_all_single

    def allreduce(self, tensors, opts=None):
        # every peer holds this rank's values: the sum is world times them
        return self._timed(lambda: [t.mul_(self._world) for t in tensors])

    def shutdown(self) -> None:
        pass


def simulated_group(world: int, bits: int = 8, rank: int = 0,
                    compile: bool | None = None) -> qcomm.QcommProcessGroup:
    """A qcomm group over :class:`SimulatedPeers` (flat: every simulated peer is on this
    machine, which the topology would send exact), ``bits`` for every collective;
    ``compile`` as :class:`qcomm.CommConfig`'s."""
    q = qcomm.QuantConfig(bits=bits)
    config = qcomm.CommConfig(all_gather=q, reduce_scatter=q, all_reduce=q, topology="flat",
                              compile=compile)
    return qcomm.QcommProcessGroup(SimulatedPeers(world, rank), config, owns_inner=False)
