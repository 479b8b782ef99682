"""torchtitan: its model's ``parallelize_fn`` wrapped, so a ``TrainSpec`` trains through
qcomm's FSDP2 route (torchtitan has no setting for custom FSDP collectives; a
``TrainSpec`` with its own ``parallelize_fn`` is its documented extension point):

    from qcomm.integrations.torchtitan import compressed
    spec = dataclasses.replace(get_train_spec("llama3"),
                               parallelize_fn=compressed(parallelize_llama))

Imports nothing of torchtitan; docs/frameworks.md says where it was run.
"""

from __future__ import annotations

import functools

from . import install

__all__ = ["compressed"]


def compressed(parallelize_fn, config=None):
    """``parallelize_fn`` (torchtitan's: model, parallel dims, job config -> the
    parallelized model), then :func:`qcomm.integrations.install` on what it returns
    (torchtitan's FSDP2 layout: a parameter-less root, bf16 MixedPrecisionPolicy,
    PREMUL_SUM: all on qcomm's hook route)."""

    @functools.wraps(parallelize_fn)
    def parallelize(model, *args, **kwargs):
        model = parallelize_fn(model, *args, **kwargs) or model
        install(model, config)
        return model

    return parallelize
