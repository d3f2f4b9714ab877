"""``hvd.elastic.ElasticSampler``: splits a dataset over the current ranks and, after a reset,
splits what is left of the epoch over the new ranks (Horovod's semantics)."""
import math
import random

import torch

from ..api.queries import rank, size


class ElasticSampler(torch.utils.data.Sampler):
    """Like ``DistributedSampler``, and it remembers how many samples of the epoch were
    processed (``record_batch``), so that a reset continues the epoch where the last commit left
    it, spread over the ranks there are now. Call ``set_epoch(e)`` at the end of each epoch.

    dataset: of constant size. shuffle: one permutation per epoch, the same on every rank
    (``random.Random(seed + epoch)``). seed: the same on every rank."""

    def __init__(self, dataset, shuffle=True, seed=0):
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.processed_num = 0
        self.reset()

    def set_epoch(self, epoch):
        self.epoch = epoch
        self.processed_num = 0
        self.reset()

    def record_batch(self, batch_idx, batch_size):
        """``batch_size`` samples were processed on every rank."""
        self.processed_num += batch_size * self.num_replicas

    def state_dict(self):
        return {"epoch": self.epoch, "processed_num": self.processed_num}

    def load_state_dict(self, state_dict):
        self.epoch = int(state_dict["epoch"])
        self.processed_num = int(state_dict["processed_num"])
        self.reset()

    def reset(self):
        """Re-split the rest of the epoch over the ranks there are now."""
        self.num_replicas = size()
        self.rank = rank()
        order = list(range(len(self.dataset)))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(order)
        self.remaining_indices = order[self.processed_num:]
        self.num_samples = int(math.ceil(len(self.remaining_indices) / self.num_replicas))
        self.total_size = self.num_samples * self.num_replicas

    def __iter__(self):
        indices = list(self.remaining_indices)
        if indices:
            indices += (indices * (1 + self.total_size // len(indices)))[:self.total_size - len(indices)]
        return iter(indices[self.rank:self.total_size:self.num_replicas])

    def __len__(self):
        return self.num_samples
