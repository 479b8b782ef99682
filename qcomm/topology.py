"""Which members of a group share a node, and the plan its collectives follow.

A group learns its members' nodes once (:mod:`qcomm.handshake`): a group made by
``init_process_group`` / ``new_group`` through the store at creation, a wrapped or
plain group with its first collective's config agreement. A node is what
:func:`qcomm.config.node_key` says (``QCOMM_NODE``, else the hostname and torchrun's
node rank). Under ``CommConfig.topology == "auto"`` the plan is::

    members on one node                  -> exact (intra_node="compress": flat)
    one rank per node                    -> flat (one level is already optimal)
    nodes with unequal numbers of ranks  -> flat, the reason logged once
    N nodes x P ranks each (any order)   -> two-level: exact inside each node,
                                            compressed among the ranks of equal
                                            local index (one per node)

``"flat"`` always runs the one-level algorithms, compressed. With P ranks a node, a
flat reduce-scatter sends each rank's W - P off-node chunks across the link (P (W - P)
a node); two-level sends N - 1 node-reduced chunks a rank (P (N - 1) a node): 2x fewer
at 2 x 2, P x fewer as N grows. All-gather likewise: W - P against N - 1 payloads a
rank.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass, field

import torch.distributed as dist

from . import inner as I

log = logging.getLogger("qcomm")

EXACT, FLAT, TWO_LEVEL = "exact", "flat", "two_level"


@dataclass(frozen=True)
class Topology:
    """The members' nodes, seen from one rank. Every member derives the same one from
    the same keys (the exchange hands every rank the same list)."""

    keys: tuple[str, ...]  # node key of each group rank
    rank: int  # this rank in the group
    node_of: tuple[int, ...] = field(init=False)  # node index of each rank (first seen)
    local_of: tuple[int, ...] = field(init=False)  # index of each rank within its node
    members: tuple[tuple[int, ...], ...] = field(init=False)  # group ranks of each node

    def __post_init__(self) -> None:
        index: dict[str, int] = {}
        members: list[list[int]] = []
        node_of, local_of = [], []
        for r, key in enumerate(self.keys):
            k = index.setdefault(key, len(index))
            if k == len(members):
                members.append([])
            node_of.append(k)
            local_of.append(len(members[k]))
            members[k].append(r)
        object.__setattr__(self, "node_of", tuple(node_of))
        object.__setattr__(self, "local_of", tuple(local_of))
        object.__setattr__(self, "members", tuple(tuple(m) for m in members))

    @property
    def nodes(self) -> int:
        return len(self.members)

    @property
    def node(self) -> int:
        """This rank's node index."""
        return self.node_of[self.rank]

    @property
    def local(self) -> int:
        """This rank's index within its node."""
        return self.local_of[self.rank]

    @property
    def per_node(self) -> int | None:
        """Ranks per node where every node has the same number, else None."""
        sizes = {len(m) for m in self.members}
        return sizes.pop() if len(sizes) == 1 else None

    @property
    def local_major(self) -> tuple[int, ...]:
        """The group ranks by (local index, node): the row order of the two-level
        exchanges (block l: the ranks of local index l, node by node); rank g sits at
        ``local_of[g] * nodes + node_of[g]``. Needs equal nodes (``per_node``)."""
        return tuple(self.members[k][local] for local in range(self.per_node)
                     for k in range(self.nodes))

    def intra_ranks(self) -> tuple[int, ...]:
        """The group ranks on this rank's node, by local index."""
        return self.members[self.node]

    def same_node_peers(self) -> int:
        """Peers of this rank on its own node."""
        return len(self.intra_ranks()) - 1

    def plan(self, topology: str, intra_node: str) -> tuple[str, str]:
        """(plan, why) under ``CommConfig.topology`` / ``intra_node``."""
        world = len(self.keys)
        if topology == "flat":
            return FLAT, "QCOMM_TOPOLOGY=flat"
        if self.nodes == 1:
            if intra_node == "compress":
                return FLAT, "one node, QCOMM_INTRA_NODE=compress"
            return EXACT, f"all {world} ranks on one node"
        if self.nodes == world:
            return FLAT, "one rank per node"
        if self.per_node is None:
            sizes = sorted({len(m) for m in self.members})
            return FLAT, f"nodes hold unequal numbers of ranks ({sizes})"
        return TWO_LEVEL, f"{self.nodes} nodes x {self.per_node} ranks"


_logged: set = set()


def log_plan_once(topo: Topology, plan: str, why: str) -> None:
    """Say once per (plan, reason) what a group of several nodes does and why; and, once
    per group, that a group of one node compresses nothing (:func:`say_one_node`)."""
    if plan == EXACT and topo.nodes == 1 and len(topo.keys) > 1:
        say_one_node(len(topo.keys), topo.keys[0])
    if topo.nodes > 1 and plan == FLAT and (plan, why) not in _logged:
        _logged.add((plan, why))
        log.info("qcomm: a %d-rank group over %d nodes runs flat (one-level) collectives: %s",
                 len(topo.keys), topo.nodes, why)


def say_one_node(world: int, node: str) -> None:
    """Every call of a group whose ``world`` ranks share one node goes exact (the
    default topology: compression only costs kernel time inside a node). Where that
    group is the whole job (every rank of the default group: two ranks tried on one
    machine, the trap a newcomer meets first) it is a ``UserWarning``, shown by default,
    since nothing would compress at all; a smaller group inside a node (HSDP's shard
    dimension, a mesh dimension) is meant to be exact, and is said at INFO."""
    text = (f"qcomm: the {world} ranks of this group share one node ({node!r}), so every "
            "call goes exact, uncompressed (inside a node qcomm sends exact); set "
            "QCOMM_INTRA_NODE=compress (CommConfig(intra_node='compress')) to compress "
            "between them, or QCOMM_NODE per rank to name their nodes apart")
    whole = dist.is_initialized() and world == dist.get_world_size()
    if whole:
        warnings.warn(text, UserWarning, stacklevel=2)
    else:
        log.info(text)


def plain_subgroups(group, rank: int | None = None) -> Subgroups:
    """The subgroup maker of a plain (gloo, NCCL) group: its store and backend from
    torch's registry of groups; its connections carry ``group``'s timeout. ``rank``:
    made on every rank alike now (:class:`Subgroups`)."""
    backend, store = dist.distributed_c10d._world.pg_map.get(group, (None, None))
    spec = backend if isinstance(backend, str) and backend != "qcomm" else None
    return Subgroups(store, group, spec, rank)


def timed_backend(group):
    """``group``'s first backend that holds a timeout (gloo's, NCCL's ``options``), where
    ``dist.set_timeout`` / ``_set_pg_timeout`` write it; None for a group without one."""
    for device in getattr(group, "_device_types", ()):
        try:
            backend = group._get_backend(device)
        except RuntimeError:
            continue
        if hasattr(getattr(backend, "options", None), "_timeout"):
            return backend
    return None


class Subgroups:
    """Inner groups made from a group's store (gloo and NCCL alike, through
    :func:`qcomm.inner.make_inner`): the two a two-level plan needs, made once, on first
    use (:meth:`get`: ``intra``, this rank's node; ``inter``, the ranks of its local
    index), and a group of all its members on connections of their own (:meth:`own`).

    Each maker reserves a namespace of its own on the store, numbered per rank as
    :func:`qcomm.handshake.check_at_creation` numbers groups, where every rank makes it
    in the same order: at its group's creation (``rank`` given: ``init_process_group``,
    ``new_group``, ``qcomm.wrap``), else at its first group (:meth:`own`, at a plain
    group's first collective through qcomm). Its groups are numbered inside it, in its
    own group's call order. So two makers on one store (a group and a wrap of it) never
    meet, whichever thread of which rank makes its groups first (an async call on the
    worker, a synchronous one on another group beside it).

    Every group made here carries the timeout of ``served``, the group whose calls they
    carry (a plain group on the hook route; a qcomm group's inner group, where
    ``dist.set_timeout`` on the qcomm group lands): read when a group is made, and
    followed when it changes (:meth:`follow`, every call), so a peer that stops raises
    at the served group's timeout, never torch's 30-minute default."""

    def __init__(self, store, served, spec: str | None, rank: int | None = None) -> None:
        self.store, self.spec = store, spec
        self._source = timed_backend(served) if served is not None else None
        self.timeout = (self._source.options._timeout if self._source is not None
                        else dist.distributed_c10d.default_pg_timeout)
        self._made: tuple | None = None
        self._groups: list = []  # every group made here, for follow()
        self._space: str | None = None  # the store prefix reserved for this maker
        if rank is not None and store is not None:
            self._reserve(rank)

    def _reserve(self, rank: int) -> None:
        if self._space is None:
            self._space = f"qcomm/sub/{self.store.add(f'qcomm/subgroups/{rank}', 1)}/"

    def follow(self) -> None:
        """Give every group made here the served group's timeout if it changed (~1 us
        a call: one read of the backend's options)."""
        if self._source is None:
            return
        timeout = self._source.options._timeout
        if timeout != self.timeout:
            self.timeout = timeout
            for group in self._groups:
                for device in group._device_types:
                    group._get_backend(device)._set_default_timeout(timeout)

    def _make(self, prefix: str, rank: int, size: int) -> dist.ProcessGroup:
        group = I.make_inner(dist.PrefixStore(prefix, self.store), rank, size, self.timeout,
                             self.spec)
        self._groups.append(group)
        return group

    def _prefix(self, rank: int) -> str:
        """The next group's store prefix, inside this maker's namespace."""
        self._reserve(rank)
        return f"{self._space}{len(self._groups)}/"

    def own(self, rank: int, size: int) -> dist.ProcessGroup:
        """A new inner group of the same ``size`` members (this one ``rank``), on
        connections of its own: what qcomm sends for a plain or wrapped group never
        shares a socket, and so never an order, with the user's calls on the group
        itself (as separate NCCL communicators)."""
        return self._make(self._prefix(rank) + "own/", rank, size)

    def sibling(self, rank: int) -> Subgroups:
        """A maker on the same store, for the same backend and timeout, whose groups are
        its own (``rank``: this one's in the group, made now on every rank alike): a
        group wrapped over this one's must never share a connection with it (their
        calls would interleave on it)."""
        other = Subgroups(self.store, None, self.spec, rank)
        other._source, other.timeout = self._source, self.timeout
        return other

    @property
    def made(self) -> tuple | None:
        """(intra, inter) where :meth:`get` has made them, else None."""
        return self._made

    def get(self, topo: Topology) -> tuple:
        if self._made is None:
            if self.store is None:
                raise RuntimeError("qcomm: a two-level plan needs the group's store")
            prefix = self._prefix(topo.rank)
            intra = self._make(f"{prefix}intra/{topo.node}/", topo.local,
                               len(topo.intra_ranks()))
            inter = self._make(f"{prefix}inter/{topo.local}/", topo.node, topo.nodes)
            self._made = (intra, inter)
        return self._made
