"""qcomm in the trainers people run: one call or one callback each.

:func:`install` is what every integration calls: it looks at the model a trainer built
and installs the route that fits it, DDP's comm hook (:func:`qcomm.ddp_comm_hook`) on a
``DistributedDataParallel``, FSDP2's (:func:`qcomm.fsdp.compress`) on a model holding
``fully_shard`` modules, and raises, naming what it found, where neither fits. The
framework modules (:mod:`qcomm.integrations.lightning`,
:mod:`qcomm.integrations.accelerate`, :mod:`qcomm.integrations.torchtitan`) import their
framework when imported themselves; ``import qcomm`` imports none of them.
docs/frameworks.md has each framework's lines, its launcher and what it refuses on CPU.
"""

from __future__ import annotations

import torch

from ..config import CommConfig, QuantConfig, as_comm_config

__all__ = ["install"]


def install(model: torch.nn.Module, config: CommConfig | QuantConfig | None = None):
    """Compress ``model``'s gradient and weight traffic on the group it already uses:
    a ``DistributedDataParallel`` gets :func:`qcomm.ddp_comm_hook` (``config``: None for
    ``QCOMM_*``, a QuantConfig for every bucket, a CommConfig as the group's whole
    config), a model with FSDP2 modules gets :func:`qcomm.fsdp.compress`. Call on every
    rank, after the model is wrapped. Returns what was installed (``"ddp"``, or the
    :class:`qcomm.fsdp.Compression`); a ValueError naming what it found where neither
    fits."""
    from torch.nn.parallel import DistributedDataParallel

    from .. import driver
    from ..ddp import ddp_comm_hook
    from ..fsdp import compress, fsdp_modules

    if config is not None and not isinstance(config, (CommConfig, QuantConfig)):
        raise TypeError(f"qcomm.integrations.install: config must be a qcomm.CommConfig, a "
                        f"qcomm.QuantConfig or None, got {config!r}")
    if isinstance(model, DistributedDataParallel):
        group = model.process_group
        state = config
        if not _is_default(group):  # the hook's state names the group; its config agreed
            if config is not None:
                device = next(model.parameters()).device
                driver.adopt(group, as_comm_config(config, "qcomm.integrations.install"),
                             device)
            state = group
        model.register_comm_hook(state, ddp_comm_hook)
        return "ddp"
    if fsdp_modules(model):
        return compress(model, config)
    raise ValueError(
        f"qcomm.integrations.install: found a {type(model).__name__}, neither a "
        "DistributedDataParallel nor a model holding fully_shard (FSDP2) modules: nothing "
        "to install on (FSDP1: init_process_group('qcomm'), the backend route)")


def _is_default(group) -> bool:
    from .. import inner

    return group is None or group is inner.default(None)
