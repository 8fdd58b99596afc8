"""torch.utils.data for training scripts: Dataset, IterableDataset, TensorDataset, Subset,
ConcatDataset, ChainDataset, random_split, the samplers, default_collate / default_convert,
DistributedSampler (torch's order) and DataLoader, whose batches are eager stepgraph tensors
(docs/TORCH_COMPAT.md, "Data").
A torch.utils.data name stepgraph lacks raises UnsupportedOpError (an AttributeError)."""
from .collate import default_collate, default_convert
from .dataloader import DataLoader, get_worker_info
from .dataset import (ChainDataset, ConcatDataset, Dataset, IterableDataset, Subset,
                      TensorDataset, random_split)
from .distributed import DistributedSampler
from .sampler import (BatchSampler, RandomSampler, Sampler, SequentialSampler,
                      SubsetRandomSampler, WeightedRandomSampler)

__all__ = ["BatchSampler", "ChainDataset", "ConcatDataset", "DataLoader", "Dataset",
           "DistributedSampler",
           "IterableDataset", "RandomSampler", "Sampler", "SequentialSampler", "Subset",
           "SubsetRandomSampler", "TensorDataset", "WeightedRandomSampler", "default_collate",
           "default_convert", "get_worker_info", "random_split"]


def __getattr__(name: str):
    """A torch.utils.data name stepgraph lacks: UnsupportedOpError, an AttributeError."""
    from ...errors import lookup_torch_name
    return lookup_torch_name(__name__, "torch.utils.data", name)
