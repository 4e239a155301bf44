"""The one evaluation: mean loss over fixed windows of the validation split.

Training evaluates on every rank with a share of the windows each (summed with
an all-reduce); validation evaluates a loaded checkpoint in one process. Both
call ``mean_loss``.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from trainpipe.trainer.data.tokens import TokenStream
from trainpipe.trainer.factory import model_loss

CPU = torch.device("cpu")


def eval_windows(stream: TokenStream, block: int, count: int) -> np.ndarray:
    """``count`` sample ids spread evenly over the split (fewer when the split is smaller)."""
    n = stream.windows(block)
    return np.linspace(0, n - 1, num=min(count, n)).astype(np.int64)


@torch.no_grad()
def mean_loss(
    model: torch.nn.Module,
    stream: TokenStream,
    ids: np.ndarray,
    block: int,
    batch: int,
    device: torch.device = CPU,
    all_ranks: bool = False,
) -> float:
    """Mean loss over samples ``ids`` in batches of ``batch``; with ``all_ranks``, over every rank's ids together."""
    was_training = model.training
    model.eval()
    sums = torch.zeros(2, dtype=torch.float64, device=device)  # loss × samples, samples
    for i in range(0, len(ids), batch):
        x, y = stream.batch(ids[i : i + batch], block, device)
        loss = model_loss(model(x, y))
        sums += torch.tensor([loss.item() * len(x), len(x)], dtype=torch.float64, device=device)
    model.train(was_training)
    if all_ranks:
        dist.all_reduce(sums)
    return (sums[0] / sums[1]).item()
