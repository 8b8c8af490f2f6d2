"""The dataloader `initialize` returns for `training_data`.

A torch DataLoader over a DistributedSampler (each rank sees its own 1/world of every
epoch) with the micro batch size. Iterating it again starts the next epoch, and the
sampler is told so, which a bare DataLoader over a DistributedSampler forgets to do.

It also knows how far into the current epoch the job is, as a global sample offset: rank r
of W takes positions r, r+W, r+2W, ... of the epoch's permutation (the same permutation at
every world size: it depends only on the seed and the epoch), so after k micro batches of
b on every rank the job has consumed positions [0, k x b x W), whatever W was. A checkpoint
records that offset; loaded (at this or any other world size), the next iteration continues
the same epoch from it, so every sample of the epoch is seen once across a resume.
"""
from __future__ import annotations

import math
from typing import Callable, Iterator, List, Optional

import torch
from torch.utils.data import DataLoader, DistributedSampler


class ResumableSampler(DistributedSampler):
    """DistributedSampler that can start an epoch at a global position (`start`). At start 0
    it is DistributedSampler itself; past it, the rest of the epoch's permutation is padded
    (or cut, with drop_last) to a multiple of the world size and strided over the ranks."""

    start = 0

    def _permutation(self) -> List[int]:
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            return torch.randperm(len(self.dataset), generator=g).tolist()
        return list(range(len(self.dataset)))

    def _per_rank(self) -> int:
        rest = len(self.dataset) - self.start
        return rest // self.num_replicas if self.drop_last else math.ceil(rest / self.num_replicas)

    def __iter__(self) -> Iterator[int]:
        if not self.start:
            return super().__iter__()
        order = self._permutation()
        rest = order[self.start:]
        total = self._per_rank() * self.num_replicas
        while len(rest) < total:  # padded from the epoch's start, as DistributedSampler pads
            rest += order[:total - len(rest)]
        return iter(rest[self.rank:total:self.num_replicas])

    def __len__(self) -> int:
        return self._per_rank() if self.start else self.num_samples


class DistributedDataLoader:
    """`sampler`: a script's own (DeepSpeed's deepspeed_io(data_sampler=...)), used as it is;
    its position is the script's, so checkpoints record none (offset() is 0)."""

    def __init__(self, dataset, batch_size: int, rank: int, world_size: int, collate_fn: Optional[Callable] = None,
                 shuffle: bool = True, seed: int = 0, num_workers: int = 0, drop_last: bool = False,
                 pin_memory: bool = False, sampler=None):
        self.dataset = dataset
        self.batch_size = batch_size
        self.world_size = world_size
        self.resumable = sampler is None
        self.sampler = sampler if sampler is not None else ResumableSampler(
            dataset, num_replicas=world_size, rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last)
        self.loader = DataLoader(dataset, batch_size=batch_size, sampler=self.sampler, collate_fn=collate_fn,
                                 num_workers=num_workers, drop_last=drop_last, pin_memory=pin_memory)
        self.epoch = 0  # epochs started
        self._resume_at = 0  # where the next iteration starts its epoch (set by a checkpoint)
        self._epoch_start = 0  # where the epoch in progress started
        self._taken = 0  # micro batches this rank has taken from the epoch in progress

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self):
        if self.resumable:
            self.sampler.set_epoch(self.epoch)
            self.sampler.start = self._epoch_start = self._resume_at
        self._resume_at = 0
        self._taken = 0
        self.epoch += 1
        return self._counted(iter(self.loader))

    def _counted(self, batches):
        for batch in batches:
            self._taken += 1
            yield batch

    def offset(self) -> int:
        """Samples of the epoch in progress the job has taken, over all ranks; 0 when no
        epoch is in progress (not started, or taken to its end)."""
        if self.epoch == 0 or not self.resumable:
            return 0
        done = self._epoch_start + self._taken * self.batch_size * self.world_size
        return done if done < len(self.dataset) else 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self._resume_at = 0

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "offset": self.offset()}

    def load_state_dict(self, state: dict) -> None:
        """The position a checkpoint recorded: the next iteration continues that epoch from
        its offset (or, without one, starts the next epoch)."""
        self.epoch = int(state["epoch"])
        offset = int(state.get("offset", 0) or 0)
        self._resume_at = 0
        if offset and self.epoch > 0 and offset < len(self.dataset):
            self.epoch -= 1
            self._resume_at = offset


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


# DeepSpeed's routes for deepspeed_io: training shuffles; evaluation and prediction read in order
ROUTE_TRAIN, ROUTE_EVAL, ROUTE_PREDICT, ROUTE_ENCODE = "train", "eval", "predict", "encode"
_SHUFFLED_ROUTES = {ROUTE_TRAIN: True, ROUTE_ENCODE: True, ROUTE_EVAL: False, ROUTE_PREDICT: False}


def route_loader(dataset, batch_size: int, rank: int, world_size: int, route: str = ROUTE_TRAIN,
                 pin_memory: bool = True, data_sampler=None, collate_fn: Optional[Callable] = None,
                 num_local_io_workers: Optional[int] = None, drop_last: bool = False,
                 shuffle: Optional[bool] = None) -> DistributedDataLoader:
    """DeepSpeed's engine.deepspeed_io, given the engine's data-parallel rank and size.

    As DeepSpeed: a torch Dataset, else ValueError; each rank reads its 1/world of the data
    (a DistributedSampler, shuffled on the train route, in order on eval and predict) unless
    the script gives its own `data_sampler`. `shuffle` (dslaunch's) overrides the route's
    choice. Worker processes default to none (DeepSpeed starts 2 per rank): the batches are
    the same either way. Pinning happens only where there is a CUDA device to pin for."""
    if not isinstance(dataset, torch.utils.data.Dataset):
        raise ValueError(f"deepspeed_io: training data must be a torch Dataset, got {type(dataset).__name__}")
    if route not in _SHUFFLED_ROUTES:
        raise ValueError(f"deepspeed_io: route {route!r} is not one of {', '.join(map(repr, _SHUFFLED_ROUTES))}")
    if isinstance(dataset, torch.utils.data.IterableDataset) and data_sampler is None:
        raise ValueError("deepspeed_io: an IterableDataset cannot be split over ranks by a sampler; shard it "
                         "by rank inside the dataset and iterate a torch DataLoader over it")
    return DistributedDataLoader(dataset, batch_size, rank, world_size, collate_fn=collate_fn,
                                 shuffle=_SHUFFLED_ROUTES[route] if shuffle is None else shuffle,
                                 num_workers=num_local_io_workers or 0, drop_last=drop_last,
                                 pin_memory=bool(pin_memory) and torch.cuda.is_available(), sampler=data_sampler)
