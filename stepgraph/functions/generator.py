"""torch.Generator and the host generator's torch names: default_generator, initial_seed,
seed, get_rng_state, set_rng_state, and `host_rng`, which every `generator=` argument goes
through.

A Generator is a NumPy Generator (PCG64) with torch's seeding interface. The same seed gives
the same draws on every run, but not torch's draws: `torch.randperm(10, generator=g)` with
`g.manual_seed(0)` is a different permutation from torch's. `default_generator` is the one
host generator that the random factories, module initialisation and unseeded shuffles draw
from (`torch.manual_seed` seeds it; it lives in nn/init.py).
"""
from __future__ import annotations

import secrets

import numpy as np

from ..devices import as_device
from ..ir.trace import Tensor, tensor_of
from ..nn import init

# torch's seed for a new Generator (torch.Generator().initial_seed()).
DEFAULT_SEED = 67280421310721
SEED_RANGE = (-(1 << 63), (1 << 64) - 1)    # what torch's manual_seed accepts
STATE_BYTES = 48                           # seed 8, PCG64 state 16, inc 16, cached uint32 8


def checked_seed(seed) -> int:
    """`seed` as torch takes it (an int in [-2^63, 2^64)), negative ones wrapped to unsigned."""
    if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, (int, np.integer)):
        raise RuntimeError(f"manual_seed expected a long, but got {type(seed).__name__}")
    if not SEED_RANGE[0] <= int(seed) <= SEED_RANGE[1]:
        raise ValueError(f"manual_seed: seed {seed} does not fit in 64 bits")
    return int(seed) % (1 << 64)


class Generator:
    """torch.Generator(device="cpu"): a seedable generator for `generator=` arguments
    (randperm, randn, rand, randint, nn.init, DataLoader, RandomSampler, random_split).

    A new one is seeded with torch's default seed (67280421310721); `manual_seed(s)` reseeds
    it and returns it, `seed()` reseeds it from the OS and returns the seed, `initial_seed()`
    is the last seed. `get_state()` / `set_state()` save and restore it as a uint8 tensor (48
    bytes, not torch's layout). Same seed, same draws on every run; not torch's draws.
    `device` is accepted and kept: draws are made on the host."""

    def __init__(self, device="cpu"):
        self.device = as_device(device)
        self.manual_seed(DEFAULT_SEED)

    @property
    def numpy_generator(self) -> np.random.Generator:
        """The NumPy Generator the draws come from."""
        return self._rng

    def manual_seed(self, seed) -> Generator:
        self._seed = checked_seed(seed)
        self._rng = np.random.default_rng(self._seed)
        return self

    def seed(self) -> int:
        seed = secrets.randbits(63)
        self.manual_seed(seed)
        return seed

    def initial_seed(self) -> int:
        return self._seed

    def get_state(self) -> Tensor:
        return tensor_of(encode_state(self._seed, self.numpy_generator))

    def set_state(self, new_state) -> Generator:
        self._seed = decode_state(new_state, self.numpy_generator)
        return self

    def __repr__(self):
        return f"<stepgraph.Generator device={self.device} seed={self.initial_seed()}>"


class DefaultGenerator(Generator):
    """torch.default_generator: the one host generator (nn/init.py's), seen as a Generator.
    torch.manual_seed reseeds it; so does its own manual_seed."""

    def __init__(self):
        self.device = as_device("cpu")

    @property
    def numpy_generator(self) -> np.random.Generator:
        return init._generator

    @property
    def _rng(self) -> np.random.Generator:
        return self.numpy_generator

    @property
    def _seed(self) -> int:
        return init._seed

    @_seed.setter
    def _seed(self, seed: int) -> None:
        init._seed = seed

    def manual_seed(self, seed) -> Generator:
        init.manual_seed(checked_seed(seed))
        return self


default_generator = DefaultGenerator()


def encode_state(seed: int, rng: np.random.Generator) -> np.ndarray:
    """A PCG64 generator's state (and its seed) as STATE_BYTES uint8 values."""
    state = rng.bit_generator.state
    if state["bit_generator"] != "PCG64":
        raise TypeError(f"get_state: a PCG64 generator is needed, got {state['bit_generator']}")
    words = (seed.to_bytes(8, "little"), state["state"]["state"].to_bytes(16, "little"),
             state["state"]["inc"].to_bytes(16, "little"),
             int(state["has_uint32"]).to_bytes(4, "little"),
             int(state["uinteger"]).to_bytes(4, "little"))
    return np.frombuffer(b"".join(words), np.uint8).copy()


def decode_state(new_state, rng: np.random.Generator) -> int:
    """Restore `rng` from what encode_state made; returns the seed it holds."""
    array = np.asarray(new_state)
    if array.dtype != np.uint8:
        raise TypeError(f"RNG state must be a uint8 tensor, got {array.dtype}")
    if array.shape != (STATE_BYTES,):
        raise RuntimeError(f"RNG state must hold {STATE_BYTES} bytes (what get_state gives), "
                           f"got shape {array.shape}")
    raw = array.tobytes()
    field = [int.from_bytes(raw[a:b], "little") for a, b in
             ((0, 8), (8, 24), (24, 40), (40, 44), (44, 48))]
    rng.bit_generator.state = {"bit_generator": "PCG64",
                               "state": {"state": field[1], "inc": field[2]},
                               "has_uint32": field[3], "uinteger": field[4]}
    return field[0]


def host_rng(generator, what: str) -> np.random.Generator:
    """The NumPy generator a `generator=` argument names: the host generator for None, a
    Generator's own, or a numpy.random.Generator as given; anything else is a TypeError."""
    if generator is None:
        return default_generator.numpy_generator
    if isinstance(generator, Generator):
        return generator.numpy_generator
    if isinstance(generator, np.random.Generator):
        return generator
    raise TypeError(f"{what}: generator must be a torch.Generator (stepgraph.Generator) or "
                    f"a numpy.random.Generator, got {type(generator).__name__}")


def initial_seed() -> int:
    """The seed the host generator was last seeded with (torch.initial_seed)."""
    return default_generator.initial_seed()


def seed() -> int:
    """Seed the host generator from the OS; returns the seed (torch.seed)."""
    return default_generator.seed()


def get_rng_state():
    """The host generator's state as a uint8 tensor (torch.get_rng_state; not torch's
    layout: restore it with set_rng_state)."""
    return default_generator.get_state()


def set_rng_state(new_state) -> None:
    """Restore the host generator from get_rng_state's tensor."""
    default_generator.set_state(new_state)


__all__ = ["Generator", "default_generator", "initial_seed", "seed", "get_rng_state",
           "set_rng_state"]
