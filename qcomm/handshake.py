"""Rank agreement: ranks find out that they disagree before any payload moves.

Gloo aborts the process (std::terminate in pair.cc, "Received data size doesn't match
expected size") when a peer sends more bytes than this rank expects, and silently leaves
the tail unwritten when it sends fewer. Payload sizes follow from (numel, dtype,
config), and whether a call is compressed at all from the config, so ranks must agree
on both. Four checks, each raising ``ValueError`` naming the field and both ranks'
values. The first three find a disagreement before any payload moves, on every rank
alike (:class:`Refused`): the outputs stay unwritten and the group usable. The fourth
runs after the payloads moved: the group fails for good (:mod:`qcomm.driver`).

1. **At creation** (:func:`check_at_creation`): groups made by ``init_process_group``
   / ``new_group`` / ``qcomm.wrap`` compare their :class:`~qcomm.CommConfig` through the
   store.
2. **At the first collective** (:meth:`Agreement.agree_config`): plain groups used
   through the direct calls or the hooks (and a wrap of a group torch has no store
   for) all-gather a config fingerprint once.

   In both, a rank that cannot read its ``QCOMM_*`` environment posts why in place of
   its config, so every rank raises at once naming the variable and the rank.
3. **Every compressed call on a CPU group** (:meth:`Agreement.check_call`), and under
   bits=auto every call of its kinds the group could compress, exact ones too: each rank
   sends every peer a 48-byte descriptor (size, dtype, config, collective, op, the
   way it goes, call index; drawn in qcomm/layout.py) and compares those it receives
   before the payloads, or the exact call, move. A check only on the first call per
   shape would be unsound: a rank that has seen its shape skips it while a rank on a
   new shape does not, and the mismatched
   messages abort gloo just the same. The descriptors travel in an envelope
   (:mod:`qcomm.envelope`, the transport): a small call's payloads ride in the same
   exchange, a call that does not ride starts it before its quantize so its latency
   hides behind the codec. CUDA groups skip it (comparing on the host would synchronize
   the stream every call).
4. **Every received payload's header** (:meth:`Agreement.check_received`), on CUDA once
   per shape.

What a group has agreed on is one object, its :class:`Agreement` (the driver's
``GroupState.agreement``): whether the config is, the history of agreed calls (the
envelope's), and the shapes a CUDA group has checked.
"""

from __future__ import annotations

import hashlib

import torch
from torch.distributed import ReduceOp

from . import inner as I
from . import layout
from .codec import check_headers
from .config import CommConfig, QuantConfig, node_key
from .envelope import Envelope, Exchange
from .layout import NO_OP

# Config fingerprint exchanged once per plain or wrapped group: sha256 hex, then repr.
CONFIG_NBYTES = 1024
# Shapes whose headers a CUDA group has checked, kept at most (a set of small tuples).
CHECKED_MAX = 4096


class Refused(ValueError):
    """Every rank refused the call alike, before any payload moved (the ranks' configs
    or call descriptors differ): the group stays in step and usable."""


# ---------------------------------------------------------------------------------
# 1. At creation, through the store


def check_at_creation(store, rank: int, size: int, config: CommConfig | None,
                      node: str = "", error: str | None = None) -> list[str]:
    """Every rank must run the same config, compared through the store once at group
    creation, so that a rank started with other ``QCOMM_*`` variables fails
    ``init_process_group`` / ``new_group`` on every rank, with the same error naming
    both configs: rank 0 compares every rank's with its own and posts the verdict,
    which every rank reads (O(world) store reads, not a comparison per pair; a rank
    that compared with rank 0 alone would miss a mismatch between two others and
    build a group whose first call fails). Each rank also posts its ``node`` key;
    returns every rank's, in rank order (the same list on every rank:
    :class:`qcomm.topology.Topology`). ``error``: why this rank has no config (a bad
    ``QCOMM_*`` value), posted in its place, so that every rank raises at once naming the
    variable and the rank, none waits out the store's timeout for a config never posted."""
    mine = ERROR_MARK + error if error is not None else repr(config.shared())
    # A store outlives its groups (torchrun's agent store; init_process_group after
    # destroy_process_group reuses the group name): each rank counts the groups it made
    # on this store, and ranks compare under that count. Unnumbered, a rank could read a
    # peer's config from the previous group (a false mismatch, or a false match).
    made = store.add(f"qcomm/made/{rank}", 1)
    store.set(f"qcomm/node/{made}/{rank}", node)
    store.set(f"qcomm/config/{made}/{rank}", mine)
    verdict = f"qcomm/verdict/{made}"
    if rank == 0:
        said = verdict_of(_read_all(store, [f"qcomm/config/{made}/{r}" for r in range(size)]),
                          "check the QCOMM_* environment variables")
        store.set(verdict, said)
    else:
        said = store.get(verdict).decode()
    if said:
        raise ValueError(said)
    return _read_all(store, [f"qcomm/node/{made}/{r}" for r in range(size)])


# What a rank that has no config posts in its place, before the reason.
ERROR_MARK = "error: "


def verdict_of(configs: list[str], hint: str, same: list[bool] | None = None) -> str:
    """The verdict on every rank's posted config (in rank order; ``same[r]``: whether
    rank r's equals rank 0's, default by the text): "" where all do; else the words
    every rank raises: the first rank that could not read its environment and why, or
    the first that differs from rank 0, both named."""
    broken = [r for r, c in enumerate(configs) if c.startswith(ERROR_MARK)]
    if broken:
        r = broken[0]
        more = f" (ranks {broken[1:]} could not either)" if len(broken) > 1 else ""
        return (f"qcomm: rank {r} cannot use its qcomm environment: "
                f"{configs[r][len(ERROR_MARK):]}{more}")
    same = same or [theirs == configs[0] for theirs in configs]
    bad = [r for r, equal in enumerate(same) if not equal]
    if not bad:
        return ""
    more = f" (and ranks {bad[1:]} differ from rank 0 too)" if len(bad) > 1 else ""
    return (f"qcomm config differs between ranks: rank 0 has {configs[0]}, rank {bad[0]} "
            f"has {configs[bad[0]]}{more} ({hint})")


def _read_all(store, keys: list[str]) -> list[str]:
    """The values of ``keys``, waiting for each to be posted."""
    if hasattr(store, "multi_get"):  # one wait and one read, not one round trip per key
        store.wait(keys)
        return [v.decode() for v in store.multi_get(keys)]
    return [store.get(k).decode() for k in keys]


# ---------------------------------------------------------------------------------
# 2. At the first collective of a plain or wrapped group: the config's fingerprint
# (Agreement.agree_config exchanges it)


NODE_NBYTES = 192  # a node key's room in the config blob (hostnames are <= 64 bytes)


def _config_blob(config: CommConfig, node: str, error: str | None = None) -> bytes:
    """sha256 hex of the config (64 bytes), the node key (NODE_NBYTES, zero-padded),
    then the config's repr, for the message; CONFIG_NBYTES in all. ``error``: why this
    rank has no config, posted in its place (:data:`ERROR_MARK`)."""
    key = node.encode()
    if len(key) > NODE_NBYTES:
        error = error or (f"QCOMM_NODE={node!r} is longer than {NODE_NBYTES} bytes")
        key = b""
    text = (ERROR_MARK + error if error is not None else repr(config.shared())).encode()
    blob = hashlib.sha256(text).hexdigest().encode() + key.ljust(NODE_NBYTES, b"\0") + text
    return blob[:CONFIG_NBYTES].ljust(CONFIG_NBYTES, b"\0")


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


class DescriptorCheck(Exchange):
    """One compressed call's descriptor check: its envelope exchange
    (:class:`qcomm.envelope.Exchange`: the transport, and the payloads that ride in it),
    finished by :meth:`finish`, which waits and compares every rank's descriptor with
    rank 0's; a mismatch is :class:`Refused` on every rank alike, in the same words
    (every rank received the same descriptors), and the call is recorded in the
    agreed history otherwise."""

    def finish(self) -> None:
        descs = self.wait()
        # every rank received the same descriptors (its own among them): each compares
        # them with rank 0's, so every rank raises the same words
        for peer, theirs in enumerate(descs):
            if theirs != descs[0]:
                self.refused()
                why = explain(descs[0], theirs, 0, peer)
                raise Refused(f"qcomm {self.kind}: ranks disagree ({why}); every rank "
                              "refused the call before any payload moved on its own: no "
                              "output was written and no state changed; the descriptors, "
                              "and any payload that rode with them, were sent (counted in "
                              "qcomm.stats as control bytes); the group stays usable")
        self.agreed()


# ---------------------------------------------------------------------------------
# 4. Every received payload's header (Agreement.check_received); and the Agreement,
# which holds what 2-4 agreed


class Agreement:
    """What the ranks of one group have agreed on, and the checks that keep it so.

    - ``config``: whether every rank is known to run the group's config: True from the
      start for groups made by ``init_process_group`` / ``new_group`` (compared through
      the store, :func:`check_at_creation`); plain and wrapped groups agree at their
      first collective (:meth:`agree_config`).
    - ``history``: the calls that passed the descriptor check, the same on every rank
      (:class:`qcomm.envelope.Envelope`: each call's envelope room follows from it);
      :meth:`check_call` starts a call's check.
    - ``checked``: the (numel, dtype, config) whose received headers a CUDA group has
      checked (:meth:`check_received`), at most :data:`CHECKED_MAX`.
    """

    def __init__(self, *, config: bool = False) -> None:
        self.config = config
        self.history = Envelope()
        self.checked: set = set()

    def agree_config(self, inner, config: CommConfig, kind: str, device: torch.device,
                     record, error: str | None = None) -> list[str]:
        """Every rank of ``inner`` must hold the same :class:`CommConfig`, or ranks would
        choose differently between compressed and exact calls: one all-gather of a
        config fingerprint (``record(kind, nbytes)`` counts its bytes), compared with
        rank 0's so that every rank raises the same words (:class:`Refused`); a rank
        that could not read its environment posts ``error`` in its place, named by
        every rank. The same exchange tells every rank each member's node: returns the
        node keys, in rank order."""
        world, rank = inner.size(), inner.rank()
        mine = _config_blob(config, node_key(), error)
        send = torch.frombuffer(bytearray(mine), dtype=torch.uint8).to(device)
        recv = torch.empty(world * CONFIG_NBYTES, dtype=torch.uint8, device=device)
        work = I.start(I.all_gather, kind, "the config agreement", rank, inner, recv, send)
        I.wait(work, kind, "the config agreement", rank)
        record(kind, (world - 1) * CONFIG_NBYTES)
        text = 64 + NODE_NBYTES
        blobs = [bytes(row) for row in recv.view(world, CONFIG_NBYTES).cpu().tolist()]
        # against rank 0's: every rank received the same blobs, so says the same words
        said = verdict_of([b[text:].rstrip(bytes(1)).decode(errors="replace") for b in blobs],
                          "check the QCOMM_* environment variables, or the config given to "
                          "qcomm.wrap", same=[b[:64] == blobs[0][:64] for b in blobs])
        if said:
            raise Refused(said)
        self.config = True
        return [b[64:text].rstrip(bytes(1)).decode(errors="replace") for b in blobs]

    def check_call(self, inner, state, kind: str, numel: int, dtype: torch.dtype,
                   q: QuantConfig, op, call: int, device: torch.device,
                   body: int = 0, path: int = 0) -> DescriptorCheck | None:
        """Start the descriptor exchange of one call (None on CUDA: see the module
        docstring); ``body``: the payload bytes for each peer that may ride in its
        envelope (0: none); ``path``: the descriptor's (layout.PATHS: compressed, or
        under bits=auto exact or undecided). ``state`` lends its buffers and counters."""
        if device.type == "cuda":
            return None
        desc = layout.encode_descriptor(kind, numel, dtype, q, op_id(op), call, path)
        return DescriptorCheck(inner, state, self.history, kind, desc, device, body)

    def check_received(self, rows: torch.Tensor, numel: int, dtype: torch.dtype,
                       q: QuantConfig, skip: int | None) -> None:
        """Check every received payload's header (``rows``: one payload a row;
        ``skip``: the row not received) with one device-to-host copy; a mismatch is a
        clear error naming the sender. A CUDA group checks each (numel, dtype, config)
        once: reading headers back costs a device sync, which would stall FSDP's
        overlap if paid per call."""
        if rows.device.type == "cuda":
            key = (numel, dtype, q)
            if key in self.checked:
                return
            if len(self.checked) >= CHECKED_MAX:
                self.checked.clear()
            self.checked.add(key)
        check_headers(rows, numel, dtype, q, skip, who="payload from rank")
