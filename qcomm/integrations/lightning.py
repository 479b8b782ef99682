"""Lightning: a Callback that installs qcomm on whatever strategy the Trainer built.

    import qcomm.integrations.lightning as ql
    trainer = L.Trainer(strategy="ddp", callbacks=[ql.Compress()])   # or FSDP2 (below)

At ``on_fit_start`` (every rank, the model wrapped) it installs DDP's comm hook on
``DDPStrategy``'s model, on CPU and CUDA alike (Lightning's own ``ddp_comm_hook=``
argument registers only where the root device is CUDA), or ``qcomm.fsdp.compress`` on a
``ModelParallelStrategy`` model whose ``configure_model`` called ``fully_shard``; it
raises where it finds neither. Imports Lightning (``lightning`` or ``pytorch_lightning``).
"""

from __future__ import annotations

try:
    from lightning.pytorch import Callback
except ImportError:  # the standalone package
    from pytorch_lightning import Callback

from . import install

__all__ = ["Compress"]


class Compress(Callback):
    """Compress the Trainer's gradient and weight traffic (:func:`qcomm.integrations.install`
    on the strategy's model at fit start). ``config``: None (``QCOMM_*``), a
    :class:`qcomm.QuantConfig`, or a :class:`qcomm.CommConfig`. :attr:`installed` says
    what it installed."""

    def __init__(self, config=None) -> None:
        self.config = config
        self.installed = None

    def on_fit_start(self, trainer, pl_module) -> None:
        if self.installed is None:  # once: a second fit reuses the model and its hooks
            model = getattr(trainer.strategy, "model", None) or pl_module
            self.installed = install(model, self.config)
