"""torch.utils.data in stepgraph against torch's: batches (values, shapes, dtypes, nesting) of
sequential loaders, collation, lengths, dataset composition and argument errors exactly;
shuffles as permutations, repeatable by seed and new each epoch; torch.Generator; and
`for x, y in BatchLoader(...)`."""
from __future__ import annotations

import collections
import time

import numpy as np
import pytest
import torch
import torch.utils.data as td

import stepgraph as sg
import stepgraph.utils.data as sd
from stepgraph.data import BatchLoader, LoaderError
from stepgraph.errors import UnsupportedOpError

Point = collections.namedtuple("Point", "x y")


def same(ours, theirs) -> None:
    """ours (stepgraph) equals theirs (torch): structure, container types, tensor shapes,
    dtypes and values exactly."""
    if isinstance(theirs, torch.Tensor):
        assert isinstance(ours, sg.Tensor) and ours.is_eager, type(ours)
        assert tuple(ours.shape) == tuple(theirs.shape)
        assert str(ours.dtype) == str(theirs.dtype).removeprefix("torch.")
        np.testing.assert_array_equal(ours.numpy(), theirs.numpy())
    elif isinstance(theirs, dict):
        assert type(ours) is type(theirs) and list(ours) == list(theirs)
        for key in theirs:
            same(ours[key], theirs[key])
    elif isinstance(theirs, (list, tuple)):
        assert type(ours) is type(theirs) and len(ours) == len(theirs), (ours, theirs)
        for a, b in zip(ours, theirs):
            same(a, b)
    else:
        assert ours == theirs and type(ours) is type(theirs)


def arrays(n: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(n)
    return rng.standard_normal((n, 3, 2)).astype(np.float32), rng.integers(0, 10, n)


def both_tensor_datasets(n: int):
    x, y = arrays(n)
    return sd.TensorDataset(x, y), td.TensorDataset(torch.from_numpy(x), torch.from_numpy(y))


class Records:
    """A map-style dataset usable by both libraries: dicts of an array, an int, a float, a
    string and a nested tuple."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {"x": np.full((2,), i, np.float32), "label": i % 3, "weight": i / 2,
                "name": f"s{i}", "pair": (np.int32(i), [i, -i])}


def make_stream(base):
    class Stream(base):
        def __init__(self, n):
            self.n = n

        def __iter__(self):
            return iter((np.float64(i), i) for i in range(self.n))

        def __len__(self):
            return self.n
    return Stream


OurStream, TorchStream = make_stream(sd.IterableDataset), make_stream(td.IterableDataset)


# ---- sequential loaders: batches exactly torch's ---------------------------------------------

@pytest.mark.parametrize("n,batch_size,drop_last", [(10, 3, False), (10, 3, True), (9, 3, True),
                                                    (5, 8, False), (5, 8, True), (7, 1, False)])
def test_tensor_dataset_batches_match_torch(n, batch_size, drop_last):
    ours, theirs = both_tensor_datasets(n)
    a = sd.DataLoader(ours, batch_size=batch_size, drop_last=drop_last)
    b = td.DataLoader(theirs, batch_size=batch_size, drop_last=drop_last)
    assert len(a) == len(b)
    batches = list(a)
    assert len(batches) == len(b)
    same(batches, list(b))


def test_map_dataset_of_records_matches_torch():
    for kwargs in ({"batch_size": 4}, {"batch_size": 4, "drop_last": True},
                   {"batch_size": None}, {"batch_size": 3, "sampler": [5, 0, 2, 2, 1]},
                   {"batch_sampler": [[3, 1], [0], [4, 2, 1]]}):
        a, b = sd.DataLoader(Records(7), **kwargs), td.DataLoader(Records(7), **kwargs)
        assert len(a) == len(b), kwargs
        same(list(a), list(b))


@pytest.mark.parametrize("kwargs", [{"batch_size": 3}, {"batch_size": 3, "drop_last": True},
                                    {"batch_size": None}, {"batch_size": 8}])
def test_iterable_dataset_matches_torch(kwargs):
    a, b = sd.DataLoader(OurStream(7), **kwargs), td.DataLoader(TorchStream(7), **kwargs)
    assert len(a) == len(b)
    same(list(a), list(b))


def test_the_tensor_fast_path_gives_what_collating_samples_gives():
    ours, _ = both_tensor_datasets(40)
    train, _ = sd.random_split(ours, [30, 10], generator=sg.Generator().manual_seed(1))
    nested = sd.Subset(train, list(range(29, -1, -2)))
    for dataset in (ours, train, nested):
        fast = sd.DataLoader(dataset, batch_size=4)
        slow = sd.DataLoader(dataset, batch_size=4, collate_fn=lambda b: sd.default_collate(b))
        for f, s in zip(fast, slow, strict=True):
            assert [t.dtype for t in f] == [t.dtype for t in s]
            for a, b in zip(f, s):
                np.testing.assert_array_equal(a.numpy(), b.numpy())


# ---- collation -------------------------------------------------------------------------------

SAMPLES = {
    "python floats": [1.5, 2.0, -3.25],
    "python ints": [1, 2, 3],
    "bools": [True, False],
    "strings": ["a", "bc"],
    "numpy scalars": [np.float32(1.5), np.float32(2)],
    "numpy int32": [np.int32(4), np.int32(-1)],
    "numpy arrays": [np.arange(6.0).reshape(2, 3), np.ones((2, 3))],
    "numpy 0-d arrays": [np.array(3, np.int64), np.array(4, np.int64)],
    "tuples": [(np.zeros(2, np.float32), 1), (np.ones(2, np.float32), 2)],
    "lists": [[1, 2.0], [3, 4.0]],
    "dicts": [{"a": 1, "b": (2.5, "x")}, {"a": 3, "b": (4.5, "y")}],
    "namedtuples": [Point(1, np.float32(2)), Point(3, np.float32(4))],
    "nested": [({"k": [1, 2]}, ("s", 0.5)), ({"k": [3, 4]}, ("t", 1.5))],
}


@pytest.mark.parametrize("name", list(SAMPLES))
def test_default_collate_matches_torch(name):
    same(sd.default_collate(SAMPLES[name]), td.default_collate(SAMPLES[name]))


def test_collate_of_tensors_stacks_them_keeping_dtype():
    rows = [np.arange(3, dtype=np.int32) + i for i in range(4)]
    same(sd.default_collate([sg.tensor(r) for r in rows]),
         td.default_collate([torch.from_numpy(r) for r in rows]))
    bf = sd.default_collate([sg.ones(2, dtype=sg.bfloat16), sg.zeros(2, dtype=sg.bfloat16)])
    assert bf.dtype == sg.bfloat16 and bf.shape == (2, 2)


def test_collate_errors_as_torch():
    bad = [
        [[1, 2], [3]],                                  # lists of unequal length
        [object(), object()],                           # not collatable
        [np.array(["a"]), np.array(["b"])],             # arrays of strings
        [np.zeros(2), np.zeros(3)],                     # arrays of different shapes
    ]
    for batch in bad:
        with pytest.raises(Exception) as theirs:
            td.default_collate(batch)
        with pytest.raises(type(theirs.value)):
            sd.default_collate(batch)


def test_default_convert_matches_torch():
    sample = {"a": np.arange(3), "b": (np.float32(1), 2, "s"), "c": [np.ones(2)]}
    same(sd.default_convert(sample), td.default_convert(sample))


# ---- argument checks -------------------------------------------------------------------------

MAP_ERRORS = [
    {"shuffle": True, "sampler": [0, 1]},
    {"batch_sampler": [[0]], "batch_size": 2},
    {"batch_sampler": [[0]], "shuffle": True},
    {"batch_sampler": [[0]], "drop_last": True},
    {"batch_sampler": [[0]], "sampler": [0]},
    {"batch_size": None, "drop_last": True},
    {"batch_size": 0},
    {"batch_size": -2},
    {"batch_size": True},
    {"drop_last": 1},
    {"num_workers": -1},
    {"timeout": -1},
    {"prefetch_factor": 2},
    {"num_workers": 2, "prefetch_factor": -1},
    {"persistent_workers": True},
]
ITERABLE_ERRORS = [{"shuffle": True}, {"sampler": [0]}, {"batch_sampler": [[0]]},
                   {"batch_size": 0}]


@pytest.mark.parametrize("kwargs", MAP_ERRORS + [dict(k, iterable=True) for k in ITERABLE_ERRORS])
def test_argument_errors_raise_as_torch(kwargs):
    kwargs = dict(kwargs)
    iterable = kwargs.pop("iterable", False)
    with pytest.raises(Exception) as theirs:
        td.DataLoader(TorchStream(4) if iterable else range(4), **kwargs)
    with pytest.raises(type(theirs.value)):
        sd.DataLoader(OurStream(4) if iterable else range(4), **kwargs)


def test_accepted_worker_arguments_and_fixed_attributes():
    loader = sd.DataLoader(range(10), batch_size=4, num_workers=4, pin_memory=True,
                           persistent_workers=True, prefetch_factor=3, timeout=5,
                           worker_init_fn=lambda i: None)
    assert [b.tolist() for b in loader] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert sd.DataLoader(range(2), num_workers=2).prefetch_factor == 2
    assert sd.get_worker_info() is None
    for name in ("batch_size", "sampler", "dataset", "drop_last"):
        with pytest.raises(ValueError, match=f"{name} attribute should not be set"):
            setattr(loader, name, None)
    loader.collate_fn = sd.default_collate


def test_sampler_argument_checks_as_torch():
    for make in (lambda m: m.RandomSampler(range(3), replacement=1),
                 lambda m: m.RandomSampler(range(3), num_samples=0),
                 lambda m: m.RandomSampler([]),
                 lambda m: m.WeightedRandomSampler([1.0, 2.0], num_samples=0),
                 lambda m: m.WeightedRandomSampler([[1.0]], num_samples=1),
                 lambda m: m.WeightedRandomSampler([1.0], num_samples=1, replacement=None),
                 lambda m: m.BatchSampler(range(3), batch_size=2, drop_last=None)):
        with pytest.raises(Exception) as theirs:
            make(td)
        with pytest.raises(type(theirs.value)):
            make(sd)


# ---- datasets --------------------------------------------------------------------------------

def test_tensor_dataset_items_and_mismatched_sizes():
    ours, theirs = both_tensor_datasets(5)
    assert len(ours) == len(theirs) == 5
    same(ours[3], theirs[3])
    same(ours[-1], theirs[-1])
    x = np.zeros((4, 2), np.float32)
    assert np.shares_memory(sd.TensorDataset(x).tensors[0].numpy(), x)
    with pytest.raises(LoaderError, match=r"size mismatch.*\[4, 3\]"):
        sd.TensorDataset(x, np.zeros(3))
    with pytest.raises(TypeError, match="tensors or NumPy arrays"):
        sd.TensorDataset([1, 2])


def test_subset_and_concat_index_as_torch():
    ours, theirs = both_tensor_datasets(6)
    ours2, theirs2 = both_tensor_datasets(4)
    cat, tcat = ours + ours2, theirs + theirs2
    assert isinstance(cat, sd.ConcatDataset) and len(cat) == len(tcat) == 10
    assert cat.cumulative_sizes == tcat.cumulative_sizes
    for i in (0, 5, 6, 9, -1, -10):
        same(cat[i], tcat[i])
    with pytest.raises(ValueError):
        cat[-11]
    sub, tsub = sd.Subset(cat, [9, 0, 6]), td.Subset(tcat, [9, 0, 6])
    assert len(sub) == 3
    same([sub[i] for i in range(3)], [tsub[i] for i in range(3)])
    same(sub.__getitems__([2, 0]), tsub.__getitems__([2, 0]))
    same(list(sd.DataLoader(sub, batch_size=2)), list(td.DataLoader(tsub, batch_size=2)))
    with pytest.raises(LoaderError, match="empty"):
        sd.ConcatDataset([])
    with pytest.raises(LoaderError, match="IterableDataset"):
        sd.ConcatDataset([OurStream(2)])
    assert list(OurStream(2) + OurStream(1)) == [(0.0, 0), (1.0, 1), (0.0, 0)]


@pytest.mark.parametrize("n,lengths", [(10, [3, 7]), (10, [0.3, 0.3, 0.4]), (11, [0.5, 0.5]),
                                       (7, [0.1, 0.2, 0.7]), (3, [1.0]), (5, [5, 0])])
def test_random_split_lengths_and_partition(n, lengths):
    parts = sd.random_split(range(n), lengths, generator=sg.Generator().manual_seed(3))
    expected = td.random_split(range(n), lengths, generator=torch.Generator().manual_seed(3))
    assert [len(p) for p in parts] == [len(p) for p in expected]
    assert sorted(i for p in parts for i in p) == list(range(n))
    again = sd.random_split(range(n), lengths, generator=sg.Generator().manual_seed(3))
    assert [list(p) for p in parts] == [list(p) for p in again]


def test_random_split_errors_as_torch():
    for lengths in ([3, 3], [1.2, -0.2], [0.5, 0.6]):
        with pytest.raises(Exception) as theirs:
            td.random_split(range(5), lengths)
        with pytest.raises(type(theirs.value)):
            sd.random_split(range(5), lengths)


# ---- shuffling and generators ----------------------------------------------------------------

def epochs(loader, count: int) -> list[list[int]]:
    return [np.concatenate([y.numpy() for _, y in loader]).tolist() for _ in range(count)]


def test_shuffle_is_a_new_permutation_each_epoch_and_repeats_by_seed():
    x = np.zeros((50, 1), np.float32)
    dataset = sd.TensorDataset(x, np.arange(50))
    loader = sd.DataLoader(dataset, batch_size=8, shuffle=True,
                           generator=sg.Generator().manual_seed(7))
    first = epochs(loader, 3)
    assert all(sorted(e) == list(range(50)) for e in first)
    assert first[0] != first[1] != first[2] and first[0] != list(range(50))
    again = sd.DataLoader(dataset, batch_size=8, shuffle=True,
                          generator=sg.Generator().manual_seed(7))
    assert epochs(again, 3) == first
    other = sd.DataLoader(dataset, batch_size=8, shuffle=True,
                          generator=sg.Generator().manual_seed(8))
    assert epochs(other, 1)[0] != first[0]
    sg.manual_seed(0)
    unseeded = epochs(sd.DataLoader(dataset, batch_size=8, shuffle=True), 2)
    sg.manual_seed(0)
    assert epochs(sd.DataLoader(dataset, batch_size=8, shuffle=True), 2) == unseeded


def test_random_samplers():
    g = sg.Generator().manual_seed(2)
    twice = list(sd.RandomSampler(range(5), num_samples=12, generator=g))
    assert len(twice) == 12 and sorted(twice[:5]) == sorted(twice[5:10]) == list(range(5))
    assert len(set(twice[10:])) == 2
    drawn = list(sd.RandomSampler(range(4), replacement=True, num_samples=200, generator=g))
    assert len(drawn) == 200 and set(drawn) == {0, 1, 2, 3}
    assert sorted(sd.SubsetRandomSampler([7, 3, 9], generator=g)) == [3, 7, 9]
    weighted = list(sd.WeightedRandomSampler([0.0, 1.0, 3.0], 300, generator=g))
    assert 0 not in weighted and 150 < weighted.count(2) < 290
    assert sorted(sd.WeightedRandomSampler([1, 0, 2, 5], 3, replacement=False)) == [0, 2, 3]
    assert list(sd.SequentialSampler(range(4))) == list(td.SequentialSampler(range(4)))
    for drop_last in (False, True):
        assert list(sd.BatchSampler(range(10), 4, drop_last)) == \
            list(td.BatchSampler(range(10), 4, drop_last))
        assert len(sd.BatchSampler(range(10), 4, drop_last)) == \
            len(td.BatchSampler(range(10), 4, drop_last))


def test_generator_and_randperm():
    g = sg.Generator()
    assert g.initial_seed() == torch.Generator().initial_seed()
    assert g.manual_seed(-1) is g and g.initial_seed() == torch.Generator().manual_seed(
        -1).initial_seed()
    assert sg.Generator(device="cuda").device == "cuda"
    g.manual_seed(5)
    perm = sg.randperm(20, generator=g)
    assert perm.dtype == sg.int64 and sorted(perm.tolist()) == list(range(20))
    assert sg.randperm(20, generator=sg.Generator().manual_seed(5)).tolist() == perm.tolist()
    state = g.get_state()
    ahead = sg.randn(4, generator=g).tolist()
    g.set_state(state)
    assert sg.randn(4, generator=g).tolist() == ahead and g.initial_seed() == 5
    assert sg.manual_seed(3) is sg.default_generator and sg.initial_seed() == 3
    saved = sg.get_rng_state()
    ahead = sg.rand(3).tolist()
    sg.set_rng_state(saved)
    assert sg.rand(3).tolist() == ahead
    assert sg.randperm(0).shape == (0,)
    for bad in (lambda m: m.randperm(-1), lambda m: m.randn(2, generator=object()),
                lambda m: m.Generator().manual_seed(1.5),
                lambda m: m.Generator().manual_seed(2 ** 64)):
        with pytest.raises(Exception) as theirs:
            bad(torch)
        with pytest.raises(type(theirs.value)):
            bad(sg)


def test_nn_init_takes_a_generator():
    a = sg.nn.init.normal_(sg.nn.Parameter(np.zeros(5)), generator=sg.Generator().manual_seed(4))
    b = sg.nn.init.normal_(sg.nn.Parameter(np.zeros(5)), generator=sg.Generator().manual_seed(4))
    np.testing.assert_array_equal(a.numpy(), b.numpy())


# ---- namespace, speed, BatchLoader -----------------------------------------------------------

def test_namespace():
    assert sg.utils.data.DataLoader is sd.DataLoader and sg.utils.data is sd
    for missing in ("utils.data.NoSuchThing", "utils.no_such_module"):
        with pytest.raises(UnsupportedOpError, match=f"torch.{missing}"):
            obj = sg
            for part in missing.split("."):
                obj = getattr(obj, part)


def test_tensor_batches_are_cheap():
    x, y = np.zeros((20000, 784), np.float32), np.zeros(20000, np.int64)
    loader = sd.DataLoader(sd.TensorDataset(x, y), batch_size=128, shuffle=True)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        count = sum(1 for _ in loader)
        best = min(best, (time.perf_counter() - start) / count)
    assert best < 1e-3, f"{best * 1e6:.0f} us per batch"


def test_batch_loader_iterates_the_next_epoch():
    x, y = np.arange(10, dtype=np.float32)[:, None], np.arange(10)
    loader = BatchLoader(x, y, 4, seed=3)
    for epoch in range(3):
        got = [yb.tolist() for _, yb in loader]
        assert got == [yb.tolist() for _, yb in loader.epoch(epoch)]
    assert loader.next_epoch == 3
    loader.set_epoch(1)
    assert [yb.tolist() for xb, yb in loader] == [yb.tolist() for _, yb in loader.epoch(1)]
    assert [len(yb) for _, yb in BatchLoader(x, y, 4, drop_last=True)] == [4, 4]
