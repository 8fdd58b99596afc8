"""Module and Parameter: the torch.nn-shaped containers that hold trained values.

A Parameter's storage is one array on its current device (NumPy or CuPy). Compiled steps read
and update that array in place, so `state_dict()` always returns the trained values and
`load_state_dict()` writes into the buffers a compiled step already uses.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Iterator, NamedTuple

import numpy as np

from ..errors import StateDictError, UnsupportedOpError
from ..ir.graph import DTYPES, ir_dtype
from ..ir.trace import Tensor, current_tracer, tensor_of
from ..loop import hooks as loop_hooks


def to_numpy(array) -> np.ndarray:
    """A host NumPy copy of a NumPy, CuPy or DLPack array."""
    if isinstance(array, np.ndarray):
        return array.copy()
    if hasattr(array, "get"):             # CuPy
        _device_synchronize()   # steps run on a private stream: wait for every one of them
        return array.get()
    if not hasattr(array, "__dlpack__") and hasattr(array, "__array__"):
        return np.array(array)            # e.g. a step's LossHandle
    return np.from_dlpack(array).copy()


def _device_synchronize() -> None:
    import cupy
    cupy.cuda.Device().synchronize()


def host_array(values) -> np.ndarray:
    """A NumPy view or copy of what a Parameter may be built from or assigned: a NumPy or CuPy
    array, a Parameter or Buffer, a tensor with .numpy() (an eager tensor, a torch tensor), or
    anything np.asarray takes (nested lists, numbers)."""
    if isinstance(values, np.ndarray):
        return values
    if isinstance(values, _Stored):
        return values.numpy()
    if hasattr(values, "get") and hasattr(values, "__cuda_array_interface__"):   # CuPy
        return values.get()
    if callable(getattr(values, "numpy", None)):
        try:
            return np.asarray(values.numpy())
        except RuntimeError:                 # a torch tensor that requires grad
            return np.asarray(values.detach().numpy())
    return np.asarray(values)


class _Stored:
    """A named array a model owns that compiled steps bind by name.

    `storage` is the array itself, on the device the last compile moved it to (NumPy, or CuPy
    after a CUDA compile); compiled steps read and write it in place. `data` is the stored
    value as torch code reaches for it: reading `p.data` gives this object back, so torch's
    in-place idioms (`p.data.fill_(0)`, `p.data.normal_(0, 0.02)`, `p.data.copy_(w)`) write
    the storage, and `p.data = values` copies values in (shape and dtype kept)."""

    storage: np.ndarray
    name: str
    # Bumped by every assign: compiled steps holding a derived copy (the bf16 weight copies of
    # precision="bf16") refresh it when the storage was written from outside the step.
    version: int = 0

    @property
    def data(self) -> _Stored:
        return self

    @data.setter
    def data(self, values) -> None:
        self.assign(values)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.storage.shape)

    @property
    def dtype(self) -> str:
        return str(self.storage.dtype)

    @property
    def ndim(self) -> int:
        return len(self.storage.shape)

    def dim(self) -> int:
        return self.ndim

    def numel(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    def size(self, dim: int | None = None):
        """The shape, or the length of axis `dim` (negative counts from the end)."""
        if dim is None:
            return self.shape
        if not -self.ndim <= dim < max(self.ndim, 1):
            raise IndexError(f"{self!r}: dim {dim} out of range for rank {self.ndim}")
        return self.shape[dim]

    def numpy(self) -> np.ndarray:
        return to_numpy(self.storage)

    def __array__(self, dtype=None, copy=None):
        host = self.numpy()
        return host if dtype is None else host.astype(dtype)

    def assign(self, values) -> None:
        """Copy values into the current storage in place (compiled steps keep their pointers)."""
        values = np.asarray(host_array(values), dtype=self.dtype)
        if values.shape != self.shape:
            raise StateDictError(f"{self.name}: expected shape {self.shape}, got {values.shape}")
        if isinstance(self.storage, np.ndarray):
            self.storage[...] = values
        else:                                # no step may still be reading the old values
            _device_synchronize()
            self.storage.set(np.asarray(values, order="C"))   # keeps 0-d buffers 0-d
            _device_synchronize()
        self.version += 1

    def _convert(self, dtype: str) -> None:
        """Hold the values in float dtype `dtype` (Module.half / float): a new storage of the
        rounded values, on the device the old one was on; integer buffers are left alone."""
        if self.dtype == dtype or self.dtype not in ("float32", "float16"):
            return
        self.storage = self.storage.astype(dtype)
        self.version += 1
        loop_hooks.changed()

    # torch's in-place initialisers (nn.init draws from the module generator)
    def fill_(self, value) -> _Stored:
        self.assign(np.full(self.shape, value))
        return self

    def zero_(self) -> _Stored:
        return self.fill_(0)

    def copy_(self, src) -> _Stored:
        """Copy `src` (any array-like of this shape) in; returns self."""
        self.assign(src)
        return self

    # ---- as a tensor in expressions (torch's Parameter is a Tensor) ----
    def as_tensor(self) -> Tensor:
        """This array as a tensor: traced inside a forward (`self.cls_token.expand(...)`,
        `self.pos_emb[:, :T]`, `self.scale * x`), else an eager tensor of a host copy."""
        tracer = current_tracer() or loop_hooks.open_pass()   # a script's loss term
        return self.traced(tracer) if tracer is not None else tensor_of(self.numpy())

    def __getattr__(self, name: str):
        if name.startswith("_") or not hasattr(Tensor, name):
            raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")
        if name.endswith("_"):                  # an in-place form: p.add_(x), p.clamp_(...)
            return lambda *args, **kwargs: self._in_place(name, args, kwargs)
        return getattr(self.as_tensor(), name)

    def _in_place(self, name: str, args: tuple, kwargs: dict) -> _Stored:
        """Tensor.<name> (an in-place form) on these values, written back through `assign`
        (compiled steps see it). Refused inside a forward: a step changes its parameters and
        buffers only through the optimizer and the ops that update them."""
        if current_tracer() is not None:
            raise UnsupportedOpError(
                f"{type(self).__name__}.{name} on {self.name or 'a module attribute'} inside "
                f"forward is not supported by stepgraph (called in "
                f"{current_tracer().where()}): use the out-of-place form")
        values = tensor_of(np.array(self.numpy()))
        self.assign(getattr(values, name)(*args, **kwargs).numpy())
        return self

    def __getitem__(self, index):
        return self.as_tensor()[index]

    def __setitem__(self, index, values) -> None:
        """`p.data[index] = values` outside forward: writes in place, as torch's does."""
        host = self.numpy()
        host[index] = host_array(values)
        self.assign(host)

    def normal_(self, mean: float = 0.0, std: float = 1.0, generator=None) -> _Stored:
        from .init import normal_
        return normal_(self, mean, std, generator=generator)

    def uniform_(self, a: float = 0.0, b: float = 1.0, generator=None) -> _Stored:
        from .init import uniform_
        return uniform_(self, a, b, generator=generator)

    def __add__(self, other):
        return self.as_tensor().__add__(other)

    def __radd__(self, other):
        return self.as_tensor().__radd__(other)

    def __sub__(self, other):
        return self.as_tensor().__sub__(other)

    def __rsub__(self, other):
        return self.as_tensor().__rsub__(other)

    def __mul__(self, other):
        return self.as_tensor().__mul__(other)

    def __rmul__(self, other):
        return self.as_tensor().__rmul__(other)

    def __truediv__(self, other):
        return self.as_tensor().__truediv__(other)

    def __rtruediv__(self, other):
        return self.as_tensor().__rtruediv__(other)

    def __matmul__(self, other):
        return self.as_tensor().__matmul__(other)

    def __pow__(self, other):
        return self.as_tensor().__pow__(other)

    def __rpow__(self, other):
        return self.as_tensor().__rpow__(other)

    def __neg__(self):
        return -self.as_tensor()

    def __invert__(self):
        return ~self.as_tensor()        # a bool mask buffer: `~self.mask`

    def __repr__(self):
        return f"{type(self).__name__}({self.name or '?'}, shape={self.shape})"


class Parameter(_Stored):
    """A trained float32 tensor; `name` is its state_dict key once owned by a model.

    `data` may be a NumPy or CuPy array, an eager tensor, a torch tensor, or anything
    np.asarray takes; it is copied (a 0-d value stays 0-d). requires_grad=False freezes it:
    compiled train steps read it as a constant input (no gradient, no update, no optimizer
    state; its values stay bit for bit) while the state_dict still holds it."""

    def __init__(self, data=None, requires_grad: bool = True):
        host = np.zeros((0,), np.float32) if data is None else host_array(data)
        self.storage = np.array(host, dtype=np.float32, order="C")
        self.name = ""
        self.requires_grad = bool(requires_grad)

    @property
    def requires_grad(self) -> bool:
        return self._requires_grad

    @requires_grad.setter
    def requires_grad(self, value: bool) -> None:
        self._requires_grad = bool(value)
        loop_hooks.changed()            # a training script's step is keyed by its trainable set

    @property
    def grad(self):
        """torch's p.grad in a training script: between loss.backward() and
        optimizer.step() a tensor of this parameter's gradient in that step, readable once
        the step ran (the step then keeps the gradients it is asked for); None where no
        backward() is waiting or after zero_grad(). Outside a script: None."""
        return loop_hooks.grad_of(self)

    @grad.setter
    def grad(self, value) -> None:
        if value is not None:
            raise UnsupportedOpError("assigning p.grad is not supported by stepgraph: "
                                     "gradients exist only inside the compiled step")

    def requires_grad_(self, requires_grad: bool = True) -> Parameter:
        """Set requires_grad in place (takes effect at the next compile); returns self."""
        self.requires_grad = bool(requires_grad)
        return self

    def __repr__(self):
        frozen = ", requires_grad=False" if not self.requires_grad else ""
        return f"Parameter({self.name or '?'}, shape={self.shape}{frozen})"

    def traced(self, tracer) -> Tensor:
        """This parameter in `tracer`'s trace: its `param` value (a frozen one's `state`
        value), made once per trace."""
        return tracer.param(self)


class Buffer(_Stored):
    """A module's non-trainable state (BatchNorm's running statistics), registered with
    `Module.register_buffer`. It keeps its dtype (num_batches_tracked is int64) and is in the
    state_dict; compiled steps bind it as graph state and update it in place."""

    def __init__(self, data):
        host = host_array(data)
        if not hasattr(data, "dtype") and host.dtype == np.float64:
            host = host.astype(np.float32)    # Python floats: torch's default float32
        self.storage = np.array(host, order="C")   # a copy: 0-d stays 0-d
        self.name = ""

    def traced(self, tracer) -> Tensor:
        """This buffer in `tracer`'s trace: its `state` value, made once per trace."""
        return tracer.buffer(self)


def state_tensor(stored: _Stored, key: str) -> Tensor:
    """An eager tensor of a host copy of a Parameter's or Buffer's values, in its dtype: what
    state_dict() holds under `key`. A copy, not a view as PyTorch's: the storage may live on
    the GPU while eager tensors hold host arrays, and a write through a view would skip
    `assign`, so compiled steps holding derived copies (precision="bf16") would not see it."""
    dtype = str(stored.storage.dtype)
    if ir_dtype(dtype) not in DTYPES:
        raise StateDictError(f"{key}: a buffer of {dtype} has no stepgraph tensor dtype "
                             f"(tensors hold {', '.join(DTYPES)}); state_dict(keep_vars=True) "
                             "gives the Buffer, whose numpy() reads it")
    return tensor_of(stored.numpy())


class IncompatibleKeys(NamedTuple):
    """What load_state_dict(strict=False) could not match, as torch's namedtuple."""

    missing_keys: list[str]
    unexpected_keys: list[str]


class Module:
    """Base class of layers, as torch.nn.Module: subclasses set Parameters, Buffers and
    sub-Modules as attributes in __init__ and write forward, which runs once, on symbolic
    tensors, when a step is compiled.

    Placement belongs to the compile call here, not to the module: to(), cuda() and cpu() are
    accepted hints that change nothing (compile_train_step's `device` decides where parameters
    live; the storage moves there then). half() holds the float parameters and buffers in
    float16 and float() back in float32, as torch's (on cuda where the ops have float16 kernels);
    double() and bfloat16() are refused (bf16 compute is compile_train_step(precision="bf16"),
    which keeps float32 master weights).
    Gradients are not kept between steps, so zero_grad() has nothing to clear."""

    def __init__(self):
        object.__setattr__(self, "_params", OrderedDict())
        object.__setattr__(self, "_modules", OrderedDict())
        object.__setattr__(self, "_buffers", OrderedDict())
        object.__setattr__(self, "_non_persistent", set())   # buffer names kept out of
        object.__setattr__(self, "training", True)            # the state_dict

    def __setattr__(self, name, value):
        if name == "training":
            loop_hooks.changed()
        if name in self._params and not isinstance(value, Parameter) and value is not None:
            raise TypeError(f"cannot assign {type(value).__name__} as parameter {name!r} (a "
                            "stepgraph.nn.Parameter or None is required; to change its values "
                            f"in place use self.{name}.data = values)")
        if isinstance(value, Parameter) or (value is None and name in self._params):
            self._params[name] = value
        elif isinstance(value, Module) or (value is None and name in self._modules):
            self._modules[name] = value
        elif isinstance(value, Buffer) or (value is None and name in self._buffers):
            self._buffers[name] = value
        object.__setattr__(self, name, value)

    def __delattr__(self, name):
        for table in (self._params, self._buffers, self._modules):
            table.pop(name, None)
        object.__delattr__(self, name)

    def _check_new_name(self, name: str, what: str) -> None:
        if not isinstance(name, str) or "." in name or not name:
            raise KeyError(f"{what} name must be a non-empty name without '.', got {name!r}")

    def register_buffer(self, name: str, array, persistent: bool = True) -> None:
        """Add non-trainable state under `name` (PyTorch's register_buffer): the attribute
        becomes a Buffer holding a copy of `array`, or None (registered, but not in the
        state_dict, as BatchNorm's statistics when it tracks none). persistent=False keeps
        it out of the state_dict too (compiled steps still bind it)."""
        self._check_new_name(name, "buffer")
        if name in self._params or name in self._modules:
            raise KeyError(f"attribute {name!r} already exists")
        self._buffers[name] = None
        if not persistent:
            self._non_persistent.add(name)
        setattr(self, name, None if array is None else Buffer(array))

    def register_parameter(self, name: str, param: Parameter | None) -> None:
        """Add a Parameter (or None: registered, not in the state_dict) under `name`."""
        self._check_new_name(name, "parameter")
        if param is not None and not isinstance(param, Parameter):
            raise TypeError(f"cannot assign {type(param).__name__} as parameter {name!r} "
                            "(a stepgraph.nn.Parameter or None is required)")
        if name in self._buffers or name in self._modules:
            raise KeyError(f"attribute {name!r} already exists")
        self._params[name] = None
        setattr(self, name, param)

    def register_module(self, name: str, module: Module | None) -> None:
        """Add a child module (or None) under `name`; add_module is the same."""
        self._check_new_name(name, "module")
        if module is not None and not isinstance(module, Module):
            raise TypeError(f"{type(module).__name__} is not a Module subclass")
        if name in self._params or name in self._buffers:
            raise KeyError(f"attribute {name!r} already exists")
        self._modules[name] = None
        setattr(self, name, module)

    add_module = register_module

    def __call__(self, *args, **kwargs):
        """forward(*args), traced under this module's path ("model.layer1.0") and label."""
        tracer = None
        for a in args:                  # the first traced tensor argument's tracer
            if isinstance(a, Tensor) and a.array is None:
                tracer = a.tracer
                break
        else:
            if kwargs:
                tracer = next((a.tracer for a in kwargs.values()
                               if isinstance(a, Tensor) and not a.is_eager), None)
        if tracer is None:
            # concrete tensors: a training script's pass (loop/), or eagerly, op by op
            handler = loop_hooks.call_handler(self)
            return self.forward(*args, **kwargs) if handler is None else \
                handler(self, args, kwargs)
        call_module = getattr(tracer, "call_module", None)   # a training script's pass
        if call_module is not None:
            return call_module(self, args, kwargs)
        with tracer.module_scope(self._trace_path(tracer), self._trace_label()):
            return self.forward(*args, **kwargs)

    def _trace_path(self, tracer) -> str:
        if not tracer.module_path and id(self) not in tracer.module_paths:
            # the root call: name every submodule once
            tracer.module_paths = {id(m): "model" + (f".{name}" if name else "")
                                   for name, m in self.named_modules()}
        path = tracer.module_paths.get(id(self))
        if path is None:                           # a module the root does not own
            path = f"{tracer.where()}.{type(self).__name__}"
        return path

    def _trace_label(self) -> str:
        """How profiles name this module's nodes: type name and a short argument list."""
        extra = self._label_args()
        return type(self).__name__ + (f"({extra})" if extra else "")

    def _label_args(self) -> str:
        return self.extra_repr()

    def forward(self, *args):
        raise NotImplementedError(type(self).__name__)

    # ---- walking the tree (torch's orders: pre-order, own members before children's) ----
    def _named_members(self, table: str, prefix: str, recurse: bool, remove_duplicate: bool):
        seen: set[int] = set()
        modules = self.named_modules(prefix=prefix, remove_duplicate=remove_duplicate) \
            if recurse else [(prefix, self)]
        for path, m in modules:
            for name, v in getattr(m, table).items():
                if v is None or (remove_duplicate and id(v) in seen):
                    continue
                seen.add(id(v))
                yield (f"{path}.{name}" if path else name), v

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[tuple[str, Parameter]]:
        """(dotted name, Parameter) pre-order: own parameters, then the children's. A
        Parameter held by several modules (weight tying) comes once, under its first name,
        as PyTorch's (remove_duplicate=False lists every name)."""
        return self._named_members("_params", prefix, recurse, remove_duplicate)

    def parameters(self, recurse: bool = True) -> Iterator[Parameter]:
        for _, p in self.named_parameters(recurse=recurse):
            yield p

    def named_buffers(self, prefix: str = "", recurse: bool = True,
                      remove_duplicate: bool = True) -> Iterator[tuple[str, Buffer]]:
        """(dotted name, Buffer) in named_parameters' order; a shared buffer once."""
        return self._named_members("_buffers", prefix, recurse, remove_duplicate)

    def buffers(self, recurse: bool = True) -> Iterator[Buffer]:
        for _, b in self.named_buffers(recurse=recurse):
            yield b

    def named_children(self) -> Iterator[tuple[str, Module]]:
        seen: set[int] = set()
        for name, m in self._modules.items():
            if m is not None and id(m) not in seen:
                seen.add(id(m))
                yield name, m

    def children(self) -> Iterator[Module]:
        for _, m in self.named_children():
            yield m

    def named_modules(self, memo: set | None = None, prefix: str = "",
                      remove_duplicate: bool = True) -> Iterator[tuple[str, Module]]:
        """This module and every submodule, pre-order, under dotted paths (prefix first); a
        module held twice comes once (memo: ids already listed), unless remove_duplicate is
        False."""
        if memo is None:
            memo = set()
        if remove_duplicate:
            if id(self) in memo:
                return
            memo.add(id(self))
        yield prefix, self
        for name, m in self._modules.items():
            if m is not None:
                yield from m.named_modules(memo, f"{prefix}.{name}" if prefix else name,
                                           remove_duplicate)

    def modules(self) -> Iterator[Module]:
        for _, m in self.named_modules():
            yield m

    def get_submodule(self, target: str) -> Module:
        """The module at dotted path `target` ("" is self)."""
        module = self
        for i, part in enumerate(target.split(".") if target else []):
            child = module._modules.get(part)
            if child is None:
                where = ".".join(target.split(".")[:i]) or type(self).__name__
                raise AttributeError(f"{where} has no submodule {part!r} (looking up "
                                     f"{target!r})")
            module = child
        return module

    def _get_member(self, target: str, table: str, what: str):
        path, _, name = target.rpartition(".")
        member = getattr(self.get_submodule(path), table).get(name)
        if member is None:
            raise AttributeError(f"{path or type(self).__name__} has no {what} {name!r}")
        return member

    def get_parameter(self, target: str) -> Parameter:
        """The Parameter at dotted path `target` ("layer1.0.weight")."""
        return self._get_member(target, "_params", "parameter")

    def get_buffer(self, target: str) -> Buffer:
        """The Buffer at dotted path `target` ("bn.running_mean")."""
        return self._get_member(target, "_buffers", "buffer")

    def apply(self, fn) -> Module:
        """fn(module) on every child (recursively) and then on self, as torch's; returns self."""
        for m in self.children():
            m.apply(fn)
        fn(self)
        return self

    # ---- modes, placement, precision ----
    def train(self, mode: bool = True) -> Module:
        if not isinstance(mode, bool):
            raise ValueError(f"training mode must be a bool, got {mode!r}")
        for m in self.modules():
            object.__setattr__(m, "training", mode)
        loop_hooks.changed()
        return self

    def eval(self) -> Module:
        return self.train(False)

    def requires_grad_(self, requires_grad: bool = True) -> Module:
        """Freeze (False) or unfreeze every parameter; the next compile sees it."""
        for p in self.parameters():
            p.requires_grad_(requires_grad)
        return self

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As optimizer.zero_grad() in a training script (loop/): the gradients kept for
        p.grad are dropped, and so is a backward() no optimizer.step() used. Otherwise
        nothing to do: a compiled step computes gradients and consumes them inside the step."""
        if loop_hooks.SESSION is not None:
            loop_hooks.SESSION.zero_grad()

    def to(self, *args, **kwargs) -> Module:
        """A placement hint (device, dtype, tensor): returns self. The compile call's device
        decides where parameters live; float32 and float16 convert as float() and half() do,
        other dtypes are refused (see the class docstring)."""
        for arg in (*args, kwargs.get("dtype"), kwargs.get("device")):   # not memory_format,
            if arg is None or _is_device(arg) or isinstance(arg, bool):     # non_blocking
                continue
            dtype = arg if isinstance(arg, (type, str)) else getattr(arg, "dtype", arg)
            name = "float16" if _dtype_name(dtype) == "half" else _dtype_name(dtype)
            if name not in ("float32", "float16"):
                self._refuse_dtype(name, "to")
            self._convert_floats(name)
        return self

    def cuda(self, device=None) -> Module:
        """A placement hint: returns self (compile with device="cuda" to run on the GPU)."""
        return self

    def cpu(self) -> Module:
        """A placement hint: returns self (compile with device="cpu" to run on NumPy)."""
        return self

    def float(self) -> Module:
        """Float parameters and buffers in float32 (after half()); returns self."""
        return self._convert_floats("float32")

    def double(self) -> Module:
        self._refuse_dtype("float64", "double")

    def half(self) -> Module:
        """Float parameters and buffers in float16, as torch's (BatchNorm's too; a script
        turns those back with float()); returns self. Trained as torch trains them: the
        optimizer updates the float16 parameters, its state float16 too."""
        return self._convert_floats("float16")

    def _convert_floats(self, dtype: str) -> Module:
        for t in [*self.parameters(), *self.buffers()]:
            t._convert(dtype)
        return self

    def bfloat16(self) -> Module:
        self._refuse_dtype("bfloat16", "bfloat16")

    def _refuse_dtype(self, dtype: str, method: str):
        raise UnsupportedOpError(
            f"{type(self).__name__}.{method}(): parameters are float32 or float16 "
            f"(asked for {dtype}); for bf16 compute compile with "
            "compile_train_step(..., precision='bf16'), which keeps float32 master weights")

    # ---- state_dict ----
    def _named_state(self, prefix: str = "", persistent_only: bool = True
                     ) -> Iterator[tuple[str, Parameter | Buffer]]:
        """PyTorch's state_dict order: per module its parameters, its buffers, then its
        children, recursively (persistent_only=False: non-persistent buffers too)."""
        for name, p in self._params.items():
            if p is not None:
                yield prefix + name, p
        for name, b in self._buffers.items():
            if b is not None and not (persistent_only and name in self._non_persistent):
                yield prefix + name, b
        for name, m in self._modules.items():
            if m is not None:
                yield from m._named_state(f"{prefix}{name}.", persistent_only)

    def name_parameters(self) -> None:
        """Give every parameter and buffer its state_dict key as its name; one held under
        several keys (weight tying) takes the first, its named_parameters name."""
        named: set[int] = set()
        for name, p in self._named_state(persistent_only=False):
            if id(p) not in named:
                named.add(id(p))
                p.name = name

    def state_dict(self, destination=None, prefix: str = "", keep_vars: bool = False):
        """Current parameters and buffers as eager tensors (their dtypes) under PyTorch's keys,
        in PyTorch's order (frozen parameters included). Each tensor holds a copy of the values
        taken now: writing it leaves the model alone, and later steps do not change it
        (PyTorch's share the parameters' storage). A tied parameter is one tensor under each
        of its keys, so torch.save writes its values once, as PyTorch's. keep_vars=True gives
        the Parameter and Buffer objects instead."""
        out = OrderedDict() if destination is None else destination
        snapshots: dict[int, Tensor] = {}
        for name, p in self._named_state(prefix):
            if keep_vars:
                out[name] = p
                continue
            if id(p) not in snapshots:
                snapshots[id(p)] = state_tensor(p, name)
            out[name] = snapshots[id(p)]
        return out

    def load_state_dict(self, state_dict, strict: bool = True) -> IncompatibleKeys:
        """Load a state_dict (NumPy arrays, tensors, or anything np.asarray accepts) in place.
        strict=True: missing or unexpected keys raise StateDictError (listing both, as torch's
        message) before anything is written; strict=False loads the keys that match and
        returns them in IncompatibleKeys. A wrong shape always raises, before any write. A
        tied parameter is written under each of its keys in order (the last wins, as in
        PyTorch)."""
        params = OrderedDict(self._named_state())
        missing = [k for k in params if k not in state_dict]
        extra = [k for k in state_dict if k not in params]
        if strict and (missing or extra):
            raise StateDictError(
                f"Error(s) in loading state_dict for {type(self).__name__}: missing keys "
                f"{missing}, unexpected keys {extra}")
        present = [(k, p) for k, p in params.items() if k in state_dict]
        for name, p in present:
            got = tuple(np.shape(host_array(state_dict[name])))
            if got != p.shape:
                raise StateDictError(f"{name}: expected shape {p.shape}, got {got}")
        self.name_parameters()
        for name, p in present:
            p.assign(state_dict[name])
        return IncompatibleKeys(missing, extra)

    # ---- printing ----
    def extra_repr(self) -> str:
        """The module's own settings, printed inside its repr (override, as in torch)."""
        return ""

    def __repr__(self):
        extra = self.extra_repr()
        lines = extra.split("\n") if extra else []
        children = [f"({k}): " + repr(m).replace("\n", "\n  ")
                    for k, m in self._modules.items() if m is not None]
        if len(lines) == 1 and not children:
            return f"{type(self).__name__}({lines[0]})"
        inner = "".join("\n  " + line for line in lines + children)
        return f"{type(self).__name__}({inner}{chr(10) if inner else ''})"


def _is_device(arg) -> bool:
    """A device argument of to(): "cpu", "cuda", "cuda:1", an int index, a device object."""
    if isinstance(arg, str):
        return arg.split(":")[0] in ("cpu", "cuda", "meta", "mps")
    return isinstance(arg, int) or (hasattr(arg, "type") and hasattr(arg, "index"))


def _dtype_name(dtype) -> str:
    """"float32" for np.float32, "float32", torch.float32 or a dtype object naming it."""
    try:
        return str(np.dtype(dtype))
    except TypeError:                        # torch.float32, stepgraph dtypes, bfloat16
        return str(dtype).rsplit(".", 1)[-1]
