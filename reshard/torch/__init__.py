"""Loading a checkpoint straight into a running PyTorch job, at its own world size and parallelism.

``load_into(model, optimizer, src)``, called on every rank after the model is parallelized, fills the
rank's DTensor shards (FSDP2, tensor parallelism, 2-D meshes) and its optimizer's per-parameter state
from any checkpoint reshard reads, each rank reading only the bytes of its boxes: no conversion step,
no second copy on disk. ``reshard.torch.shards`` turns the job's placements into a layout the planner
intersects with the checkpoint's; ``reshard.torch.loading`` reads and sets the state.

This layer sits above the entry points (``reshard.api``) and imports torch, unlike the layers below it.
"""

from reshard.torch.loading import LoadReport, load_into

__all__ = ["LoadReport", "load_into"]
