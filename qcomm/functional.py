"""torch's functional collectives (``torch.ops._c10d_functional``) on a qcomm group.

What compiled code and DTensor emit reaches a process group from C++. Most ops call
the group's Python methods (the plain and coalesced forms, tested op by op in
tests/test_contracts.py), but ``all_gather_into_tensor_out`` (what Inductor's bucketing
and FSDP passes emit) calls ``_allgather_base`` on the group's registered backend, which
for a qcomm group is its inner gloo/NCCL backend: the call would bypass qcomm, go
uncounted and race the calls on the group's worker. :func:`install` gives that op a
CPU and CUDA kernel of its own (more specific than torch's CompositeExplicitAutograd
one, which stays for every other device): on a qcomm group it runs the group's
``all_gather_single`` (compressed where the group compresses, ordered with its other
calls, counted); on any other group it does what torch's kernel does (the group's
``_allgather_base``, the Work registered for ``wait_tensor``). It is installed when the
first qcomm group is made, so a process that never makes one runs torch's kernel.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

_c10d = dist.distributed_c10d
_library: torch.library.Library | None = None


def _group(group_name) -> dist.ProcessGroup:
    """The group a functional op names (torch >= 2.13 may pass the group itself)."""
    if isinstance(group_name, dist.ProcessGroup):
        return group_name
    return _c10d._resolve_process_group(group_name)


def _all_gather_into_tensor_out(input: torch.Tensor, group_size: int, group_name, *,
                                out: torch.Tensor) -> torch.Tensor:
    group = _group(group_name)
    if group_size != group.size():
        raise ValueError(f"all_gather_into_tensor_out: group_size {group_size} but the "
                         f"group has {group.size()} ranks")
    if getattr(group, "_qcomm_state", None) is not None:  # a QcommProcessGroup (which
        # imports this module)
        work = group.all_gather_single(out, input)
    else:
        work = group._allgather_base(out, input, _c10d.AllgatherOptions())
    torch._C._distributed_c10d._register_work(out, work)
    return out


def install() -> None:
    """Give ``_c10d_functional::all_gather_into_tensor_out`` qcomm's CPU and CUDA kernel
    (idempotent)."""
    global _library
    if _library is not None or not hasattr(torch.ops._c10d_functional,
                                           "all_gather_into_tensor_out"):
        return
    library = torch.library.Library("_c10d_functional", "IMPL")
    for key in ("CPU", "CUDA"):
        library.impl("all_gather_into_tensor_out", _all_gather_into_tensor_out, key)
    _library = library
