"""Accelerate: one call after ``prepare``.

    import qcomm.integrations.accelerate as qa
    model, opt, data = accelerator.prepare(model, opt, data)
    qa.compress(accelerator, model)

``prepare`` returns a ``DistributedDataParallel`` on several processes (on CPU too: its
FSDP2 plugin is a CUDA feature there), which gets DDP's comm hook; a model the user
sharded with ``fully_shard`` gets ``qcomm.fsdp.compress``. Imports Accelerate.
"""

from __future__ import annotations

import accelerate

from . import install

__all__ = ["compress"]


def compress(accelerator: accelerate.Accelerator, model, config=None):
    """:func:`qcomm.integrations.install` on the model ``accelerator.prepare`` returned
    (or one sharded by ``fully_shard``); on every process. A single process has nothing
    to compress: a ValueError."""
    if accelerator.num_processes < 2:
        raise ValueError("qcomm.integrations.accelerate.compress: one process, nothing to "
                         "compress (launch several: torchrun --nproc-per-node N script.py)")
    return install(model, config)
