"""The dataloader `initialize` returns for `training_data`.

A torch DataLoader over a DistributedSampler (each rank sees its own 1/world of every
epoch) with the micro batch size. Iterating it again starts the next epoch, and the
sampler is told so, which a bare DataLoader over a DistributedSampler forgets to do.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch.utils.data import DataLoader, DistributedSampler


class DistributedDataLoader:
    def __init__(self, dataset, batch_size: int, rank: int, world_size: int, collate_fn: Optional[Callable] = None,
                 shuffle: bool = True, seed: int = 0, num_workers: int = 0, drop_last: bool = False,
                 pin_memory: bool = False):
        self.dataset = dataset
        self.batch_size = batch_size
        self.sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=shuffle, seed=seed,
                                          drop_last=drop_last)
        self.loader = DataLoader(dataset, batch_size=batch_size, sampler=self.sampler, collate_fn=collate_fn,
                                 num_workers=num_workers, drop_last=drop_last, pin_memory=pin_memory)
        self.epoch = 0

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self):
        self.sampler.set_epoch(self.epoch)
        self.epoch += 1
        return iter(self.loader)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def state_dict(self) -> dict:
        return {"epoch": self.epoch}

    def load_state_dict(self, state: dict) -> None:
        self.epoch = int(state["epoch"])


def move_to(batch, device: torch.device):
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, (list, tuple)):
        return type(batch)(move_to(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: move_to(v, device) for k, v in batch.items()}
    return batch


class RepeatingLoader:
    """DeepSpeed's RepeatingLoader: iterate `loader` forever, starting it again (a new
    epoch, when it is a DistributedDataLoader) each time it runs out. What
    PipelineEngine.train_batch wants: a fixed number of micro-batches per call."""

    def __init__(self, loader):
        self.loader = loader
        self.data_iter = iter(loader)

    def __iter__(self):
        return self

    def __next__(self):
        try:
            return next(self.data_iter)
        except StopIteration:
            self.data_iter = iter(self.loader)
            return next(self.data_iter)
