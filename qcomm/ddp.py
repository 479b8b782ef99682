"""DDP's comm hook: each gradient bucket's all-reduce compressed, on DDP's own group.

    ddp = DistributedDataParallel(model)                 # gloo or NCCL, unchanged
    ddp.register_comm_hook(None, qcomm.ddp_comm_hook)    # QCOMM_* config
    ddp.register_comm_hook(qcomm.QuantConfig(bits=4), qcomm.ddp_comm_hook)

What torch's own ``fp16_compress_hook`` and PowerSGD do, through qcomm's driver: the
bucket is averaged (AVG) by the scatter-reduce-allgather all-reduce of
:func:`qcomm.all_reduce`, asynchronously (the hook returns the call's future, DDP's
reducer waits on it), with the group's topology, seeds and stats
(``qcomm.stats(group)``); buckets that must stay exact (integer or float64 gradients,
under ``min_numel``) go exact. ``state``: None (the default group, ``QCOMM_*``), a
:class:`~qcomm.QuantConfig` (the default group, that config for every bucket), a
:class:`~qcomm.CommConfig` (the default group's whole config, every field of it:
``topology``, ``intra_node``, ``auto``, ``min_numel``...; agreed by every rank at the
first bucket, and a ValueError naming both where the group already runs another), or a
process group (its ``QCOMM_*`` config), as torch's hooks take theirs.
"""

import torch
import torch.distributed as dist

from . import collectives as C
from . import driver
from .config import CommConfig, QuantConfig


# DDP checks this annotation (Future[Tensor]) literally: no postponed annotations here.
def ddp_comm_hook(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """A DDP comm hook (``ddp.register_comm_hook(state, qcomm.ddp_comm_hook)``): the
    bucket's gradients averaged over the group, compressed; the future holds them."""
    if state is None or isinstance(state, QuantConfig):
        group, config = None, state
    elif isinstance(state, CommConfig):  # the group's config, all of it
        group, config = None, None
        driver.adopt(None, state, bucket.buffer().device)
    elif isinstance(state, dist.ProcessGroup):
        group, config = state, None
    else:
        raise TypeError("qcomm.ddp_comm_hook: state must be None, a qcomm.QuantConfig, a "
                        f"qcomm.CommConfig or a process group, got {type(state).__name__}")
    tensor = bucket.buffer()
    work = C.all_reduce(tensor, dist.ReduceOp.AVG, group, config=config, async_op=True)
    # the bucket itself, or the call's own error (a refusal stays a Refused: ``then``
    # would wrap it in a RuntimeError)
    done: torch.futures.Future = torch.futures.Future()

    def finished(fut) -> None:
        try:
            done.set_result(fut.value()[0])
        except Exception as err:  # noqa: BLE001 (delivered through the future)
            done.set_exception(err)

    work.get_future().add_done_callback(finished)
    return done
