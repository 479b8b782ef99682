"""qcomm: quantized collectives for sharded training.

``import qcomm`` registers the ``"qcomm"`` torch.distributed backend; the codec
(:func:`quantize`, :func:`dequantize`, :func:`packed_nbytes`) works on its own.
``import qcomm.fsdp`` adds FSDP2's comm hooks (:func:`qcomm.fsdp.compress`, compression
without swapping the process group) and per-module weight differences and error
feedback; :func:`ddp_comm_hook` is DDP's.
"""

__version__ = "0.1.0"

from .codec import (  # noqa: E402
    Packed,
    dequantize,
    dequantize_rows,
    dequantize_sum,
    describe,
    quantize,
    quantize_rows,
    update_state_rows,
)
from .collectives import all_gather_into_tensor, all_reduce, reduce_scatter_tensor  # noqa: E402
from .config import CommConfig, QuantConfig, comm_config_from_env  # noqa: E402
from .ddp import ddp_comm_hook  # noqa: E402
from .driver import auto_model, stats  # noqa: E402
from .layout import packed_nbytes  # noqa: E402
from .process_group import QcommProcessGroup, register, wrap  # noqa: E402
from .purpose import exact  # noqa: E402
from .stats import CollectiveStats  # noqa: E402

register()

__all__ = [
    "CollectiveStats",
    "CommConfig",
    "Packed",
    "QcommProcessGroup",
    "QuantConfig",
    "all_gather_into_tensor",
    "all_reduce",
    "auto_model",
    "comm_config_from_env",
    "ddp_comm_hook",
    "dequantize",
    "dequantize_rows",
    "dequantize_sum",
    "describe",
    "exact",
    "packed_nbytes",
    "quantize_rows",
    "quantize",
    "reduce_scatter_tensor",
    "stats",
    "update_state_rows",
    "wrap",
]
