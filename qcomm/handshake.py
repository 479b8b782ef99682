"""Rank agreement: ranks find out that they disagree before any payload moves.

Gloo aborts the process (std::terminate in pair.cc, "Received data size doesn't match
expected size") when a peer sends more bytes than this rank expects, and silently leaves
the tail unwritten when it sends fewer. Payload sizes follow from (numel, dtype,
config), and whether a call is compressed at all from the config, so ranks must agree
on both. Four checks, each raising ``ValueError`` naming the field and both ranks'
values, with the outputs unwritten and the group usable:

1. **At creation** (:func:`check_at_creation`): groups made by ``init_process_group``
   / ``new_group`` compare their :class:`~qcomm.CommConfig` through the store.
2. **At the first collective** (:func:`ensure_agreed`): groups made by ``qcomm.wrap``
   and plain groups used through the direct calls all-gather a config fingerprint once.
3. **Every compressed call on a CPU group** (:func:`start_descriptor_check`): the ranks
   all-gather a 48-byte descriptor (size, dtype, config, collective, op, call index;
   drawn in qcomm/layout.py), started before the quantize so its latency hides behind
   the codec, and compare it before the payload exchange. Measured (2 ranks, loopback,
   2 busy cores): a 48-byte gloo all-gather costs ~0.5 ms against ~1.4 ms for a
   compressed all-gather of 1024 fp32 and ~57 ms of 2^20. A check only on the first
   call per shape would be unsound: a rank that has seen its shape skips it while a rank
   on a new shape does not, and the mismatched messages abort gloo just the same. CUDA
   groups skip it (comparing on the host would synchronize the stream every call).
   A small one-piece call's payloads ride in the same exchange (the *envelope*,
   :class:`Envelope`): one exchange a call instead of two.
4. **Every received payload's header** (:func:`check_received`), on CUDA once per shape.
"""

from __future__ import annotations

import hashlib

import torch
from torch.distributed import ReduceOp

from . import inner as I
from . import layout
from .codec import check_headers
from .config import CommConfig, QuantConfig, node_key
from .layout import DESC_NBYTES, NO_OP

# Config fingerprint exchanged once per plain or wrapped group: sha256 hex, then repr.
CONFIG_NBYTES = 1024
# Shapes whose headers a CUDA group has checked, kept at most (a set of small tuples).
CHECKED_MAX = 4096


# ---------------------------------------------------------------------------------
# 1. At creation, through the store


def check_at_creation(store, rank: int, size: int, config: CommConfig,
                      node: str = "") -> list[str]:
    """Every rank must run the same config, compared through the store once at group
    creation (rank 0 against all; every other rank against rank 0), so that a rank
    started with other ``QCOMM_*`` variables fails ``init_process_group`` / ``new_group``
    naming both configs. Each rank also posts its ``node`` key; returns every rank's,
    in rank order (the same list on every rank: :class:`qcomm.topology.Topology`)."""
    mine = repr(config)
    # A store outlives its groups (torchrun's agent store; init_process_group after
    # destroy_process_group reuses the group name): each rank counts the groups it made
    # on this store, and ranks compare under that count. Unnumbered, a rank could read a
    # peer's config from the previous group (a false mismatch, or a false match).
    made = store.add(f"qcomm/made/{rank}", 1)
    store.set(f"qcomm/node/{made}/{rank}", node)
    store.set(f"qcomm/config/{made}/{rank}", mine)
    peers = range(1, size) if rank == 0 else (0,)
    for peer in peers:
        theirs = store.get(f"qcomm/config/{made}/{peer}").decode()
        if theirs != mine:
            raise ValueError(
                f"qcomm config differs between ranks: rank {rank} has {mine}, rank {peer} "
                f"has {theirs} (check the QCOMM_* environment variables)"
            )
    keys = [f"qcomm/node/{made}/{r}" for r in range(size)]
    if hasattr(store, "multi_get"):  # one wait and one read, not one round trip per rank
        store.wait(keys)  # a peer may not have posted yet (only rank 0 waited for all)
        return [v.decode() for v in store.multi_get(keys)]
    return [store.get(k).decode() for k in keys]


# ---------------------------------------------------------------------------------
# 2. At the first collective of a plain or wrapped group


NODE_NBYTES = 192  # a node key's room in the config blob (hostnames are <= 64 bytes)


def _config_blob(config: CommConfig, node: str) -> bytes:
    """sha256 hex of the config (64 bytes), the node key (NODE_NBYTES, zero-padded),
    then the config's repr, for the message; CONFIG_NBYTES in all."""
    key = node.encode()
    if len(key) > NODE_NBYTES:
        raise ValueError(f"qcomm node key {node!r} is longer than {NODE_NBYTES} bytes "
                         "(QCOMM_NODE)")
    text = repr(config).encode()
    blob = hashlib.sha256(text).hexdigest().encode() + key.ljust(NODE_NBYTES, b"\0") + text
    return blob[:CONFIG_NBYTES].ljust(CONFIG_NBYTES, b"\0")


def ensure_agreed(group, state, inner, kind: str, device: torch.device) -> None:
    """Once per plain or wrapped group, at its first collective through qcomm: every
    rank must hold the same :class:`CommConfig` (``state.config``), or ranks would
    choose differently between compressed and exact calls; the same exchange tells
    every rank each member's node (``state.learn_topology``)."""
    if state.agreed or group.size() == 1:
        return
    with state.lock:
        if state.agreed:
            return
        world, rank = inner.size(), inner.rank()
        mine = _config_blob(state.config, node_key())
        send = torch.frombuffer(bytearray(mine), dtype=torch.uint8).to(device)
        recv = torch.empty(world * CONFIG_NBYTES, dtype=torch.uint8, device=device)
        work = I.start(I.all_gather, kind, "the config agreement", rank, inner, recv, send)
        I.wait(work, kind, "the config agreement", rank)
        state.stats.record_control(kind, (world - 1) * CONFIG_NBYTES)
        keys = []
        text = 64 + NODE_NBYTES
        for peer, row in enumerate(recv.view(world, CONFIG_NBYTES).cpu().tolist()):
            theirs = bytes(row)
            if theirs[:64] != mine[:64]:
                raise ValueError(
                    f"qcomm config differs between ranks: rank {rank} has "
                    f"{mine[text:].rstrip(bytes(1)).decode()}, rank {peer} has "
                    f"{theirs[text:].rstrip(bytes(1)).decode(errors='replace')} (check "
                    "the QCOMM_* environment variables, or the config given to qcomm.wrap)")
            keys.append(theirs[64:text].rstrip(bytes(1)).decode(errors="replace"))
        state.learn_topology(keys, rank)
        state.agreed = True


# ---------------------------------------------------------------------------------
# 3. Every compressed call on a CPU group: the call descriptor


def op_id(op) -> int:
    """The descriptor's op byte: ``op``'s RedOpType value, or NO_OP for None."""
    return NO_OP if op is None else int(getattr(op, "op", op))


def _op_name(op: int) -> str:
    if op == NO_OP:
        return "none (all-gather)"
    names = {int(v): k for k, v in ReduceOp.RedOpType.__members__.items()}
    return names.get(op, str(op))


def explain(mine: bytes, theirs: bytes, rank: int, peer: int) -> str:
    """What differs between two descriptors, field by field."""
    a = layout.decode_descriptor(mine)
    try:
        b = layout.decode_descriptor(theirs)
    except ValueError as err:
        return f"rank {peer} sent no qcomm descriptor ({err})"
    diff = []
    if a["kind"] != b["kind"]:
        diff.append(f"collective: rank {peer} is in {b['kind']}, rank {rank} in {a['kind']}")
    if a["op_id"] != b["op_id"]:
        diff.append(f"reduce op: rank {peer} has {_op_name(b['op_id'])}, "
                    f"rank {rank} {_op_name(a['op_id'])}")
    diff += [f"{k}: rank {peer} has {b[k]!r}, rank {rank} {a[k]!r}"
             for k in a if k not in ("kind", "op_id", "call") and a[k] != b[k]]
    if a["call"] != b["call"]:
        diff.append(f"call index: rank {peer} is at compressed call {b['call']}, rank {rank} "
                    f"at {a['call']} (a rank skipped or added a collective)")
    return "; ".join(diff) or "descriptors differ in reserved bytes"


# The envelope: every compressed call of a CPU group all-gathers ENVELOPE = DESC_NBYTES +
# room bytes per rank, its descriptor then (a small one-piece call) its payloads, zero
# padded; the payloads of a call that does not fit follow in a second exchange, as
# before. Both sizes must match on every rank before anything is compared (gloo aborts
# on a mismatch), so ``room`` follows only from what every rank has already agreed on:
# the largest body of the last ENVELOPE_WINDOW calls that passed this check (identical
# descriptors, so identical bodies) that fitted under the cap. Repeated shapes (a
# training step's modules) ride from their second call; the first call of a group
# sends the bare descriptor. A call that does not fit sends at most the cap in padding
# (hidden behind its first quantize, as the descriptor was).
# Measured (`python bench/experiments/envelope_toggle.py 8`, baa06fe, 2 ranks on
# loopback, 8 bits; bench/results/cpu-amd-epyc-2c-avx512/envelope-toggle.txt): the
# separate descriptor exchange is 32-54% of a small call, 2^10-2^16 elements, all-gather
# and reduce-scatter (2^10 all-gather 1773 us with it, 1141 unchecked).
# The cap: a 2^16-element 8-bit reduce-scatter on 2 ranks (two 66 080-byte slots) rides.
# At 72 KiB it did not, and paid the room its all-gathers had set as padding before its
# own all-to-all: 1.58x the pre-envelope call (small_calls.py, 4 rounds, 2026-12-03).
ENVELOPE_WINDOW = 8
ENVELOPE_ROOM_MAX = 136 * 1024
ENVELOPE_TOTAL_MAX = 272 * 1024  # bytes a rank receives: room x world at most


def envelope_cap(world: int) -> int:
    """The most body bytes an envelope of a ``world``-rank group carries (16-byte
    multiples: payload rows stay aligned)."""
    return min(ENVELOPE_ROOM_MAX, ENVELOPE_TOTAL_MAX // max(world, 1)) // 16 * 16


class Envelope:
    """The bodies of the last calls that passed the descriptor check (a group's state):
    every rank holds the same, so every rank derives the same envelope size."""

    def __init__(self) -> None:
        self.bodies: list[int] = []

    def room(self) -> int:
        return max(self.bodies, default=0)

    def agreed(self, body: int, cap: int) -> None:
        self.bodies.append(body if body <= cap else 0)
        del self.bodies[:-ENVELOPE_WINDOW]


class DescriptorCheck:
    """One descriptor exchange, and the envelope it travels in.

    ``body`` (bytes): what the call would send in the envelope (0: nothing; its
    payloads always go on their own). Where it fits the agreed room (:attr:`rides`),
    the caller writes its payloads into :meth:`payload` and calls :meth:`start`;
    otherwise the exchange starts at once, before the quantize. :meth:`finish` waits and
    compares; then the riding payloads are in :meth:`received`."""

    def __init__(self, inner, state, kind: str, desc: bytes, device: torch.device,
                 body: int = 0) -> None:
        self.kind, self.desc, self.rank, self.state = kind, desc, inner.rank(), state
        self.inner, self.world, self.body = inner, inner.size(), body
        self.cap = envelope_cap(self.world)
        room = state.envelope.room()
        self.size = DESC_NBYTES + room
        self.rides = 0 < body <= room
        self.send = state.buffers.get("desc_send", self.size, torch.uint8, device)
        self.send[:DESC_NBYTES].copy_(torch.frombuffer(bytearray(desc), dtype=torch.uint8))
        # zeros where no payload goes: no bytes of an earlier call on the wire
        self.send[DESC_NBYTES:].zero_()
        self.recv = state.buffers.get("desc_recv", self.world * self.size, torch.uint8,
                                      device)
        self.work = None
        if not self.rides:
            self.start()

    def payload(self) -> torch.Tensor:
        """The ``body`` bytes of this rank's envelope after the descriptor (riding)."""
        return self.send[DESC_NBYTES:DESC_NBYTES + self.body]

    def start(self) -> None:
        self.work = I.start(I.all_gather, self.kind, "the descriptor exchange", self.rank,
                            self.inner, self.recv, self.send)
        control = self.size - (self.body if self.rides else 0)
        self.state.stats.record_control(self.kind, (self.world - 1) * control)

    def received(self, offset: int, nbytes: int) -> torch.Tensor:
        """[world, nbytes] rows: bytes ``[offset, offset + nbytes)`` of every rank's
        body, in rank order (a strided view of the envelopes received)."""
        return self.recv.as_strided((self.world, nbytes), (self.size, 1),
                                    self.recv.storage_offset() + DESC_NBYTES + offset)

    def finish(self) -> None:
        if self.work is None:
            raise RuntimeError("qcomm: a riding envelope was finished before it was sent")
        I.wait(self.work, self.kind, "the descriptor exchange", self.rank)
        rows = self.recv.view(-1, self.size)[:, :DESC_NBYTES]
        for peer, row in enumerate(rows.tolist()):
            theirs = bytes(row)
            if theirs != self.desc:
                why = explain(self.desc, theirs, self.rank, peer)
                raise ValueError(f"qcomm {self.kind}: ranks disagree ({why}); "
                                 "nothing was sent or written")
        self.state.envelope.agreed(self.body, self.cap)


def start_descriptor_check(inner, state, kind: str, numel: int, dtype: torch.dtype,
                           q: QuantConfig, op, call: int, device: torch.device,
                           body: int = 0) -> DescriptorCheck | None:
    """Start the descriptor exchange of one compressed call (None on CUDA: see above);
    ``body`` as :class:`DescriptorCheck`."""
    if device.type == "cuda":
        return None
    desc = layout.encode_descriptor(kind, numel, dtype, q, op_id(op), call)
    return DescriptorCheck(inner, state, kind, desc, device, body)


# ---------------------------------------------------------------------------------
# 4. Every received payload's header


def check_received(rows: torch.Tensor, numel: int, dtype: torch.dtype, q: QuantConfig,
                   skip: int | None, state) -> None:
    """Check every received payload's header (``rows``: one payload a row; ``skip``: the
    row not received) with one device-to-host copy; a mismatch is a clear error naming
    the sender. A CUDA group checks each (numel, dtype, config) once: reading headers
    back costs a device sync, which would stall FSDP's overlap if paid per call."""
    if rows.device.type == "cuda":
        key = (numel, dtype, q)
        if key in state.checked:
            return
        if len(state.checked) >= CHECKED_MAX:
            state.checked.clear()
        state.checked.add(key)
    check_headers(rows, numel, dtype, q, skip, who="payload from rank")
