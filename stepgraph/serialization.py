"""torch.save / torch.load: PyTorch's checkpoint file format, read and written without torch.

The format torch 2.x writes is a zip archive whose records sit under one top folder:
- `data.pkl`: a protocol-2 pickle of the saved object, in which each tensor is the call
  `torch._utils._rebuild_tensor_v2(storage, offset, size, stride, requires_grad, hooks)` and
  each storage the persistent id `("storage", torch.<Kind>Storage, key, location, numel)`;
- `data/<key>`: each storage's raw bytes, at a 64-byte aligned offset in the file (an
  `FB` extra field pads the local header, as torch's writer does, so torch's mmap loads work);
- `version`, `.format_version`, `.storage_alignment` and `byteorder` ("little" or "big").
The legacy format (`torch.save(..., _use_new_zipfile_serialization=False)`) is a run of
pickles (magic number, protocol, system info, the object, the storage keys) followed by each
storage as an 8-byte element count and its bytes; it is read, not written.

Saving writes the pickle opcodes itself (`_PickleWriter`): torch's globals are names in the
file, and writing them as names needs no torch (Python's pickler would import each one).

Loading is always what torch calls `weights_only`: a pickle may name only the globals that
rebuild tensors and plain containers (`_ALLOWED`), each handed out as a wrapper the pickle
cannot modify, and the result is copied into fresh containers (`_finish`). Any other global
(`os.system`, a user class) raises `UnsafePickleError` naming it; nothing in a file is ever
run, whatever `weights_only` says. Tensors load as stepgraph eager tensors holding copies of
the file's values (bfloat16 as its uint16 bits, as every stepgraph tensor holds it).
"""
from __future__ import annotations

import codecs
import io
import os
import pickle
import struct
import zipfile
from collections import Counter, OrderedDict
from dataclasses import dataclass

import numpy as np

from .devices import device
from .dtypes import TORCH_DTYPES, dtype
from .errors import StepgraphError
from .ir.graph import BF16, storage_dtype
from .ir.trace import Size, Tensor, tensor_of
from .nn.module import Parameter, _Stored, to_numpy

ARCHIVE = "archive"            # the zip's top folder, as torch names it for file objects
ALIGNMENT = 64                 # storage records start at multiples of this offset
LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
LEGACY_PROTOCOL = 1001
ONLY_WEIGHTS = ("only tensors and plain containers (dict, OrderedDict, list, tuple, set, "
                "numbers, strings, bytes, None, torch.Size, dtypes, devices) load")
NO_CODE = ("weights_only=False does not change this: stepgraph never runs code from a "
           "checkpoint")


class SerializationError(StepgraphError, RuntimeError):
    """A file torch.load cannot read (not torch's format, corrupt, a tensor dtype stepgraph
    tensors cannot hold), or an object torch.save cannot write."""


class UnsafePickleError(StepgraphError, pickle.UnpicklingError):
    """A checkpoint's pickle names a global other than those that rebuild tensors and plain
    containers (as torch's weights_only load refuses it); names the global."""


def _refused(what: str) -> UnsafePickleError:
    return UnsafePickleError(f"torch.load refused {what}: {ONLY_WEIGHTS}, and nothing in the "
                             f"file is run ({NO_CODE})")


def _no_build(self, state) -> None:
    """__setstate__ of the objects the unpickler hands to a pickle (storage kinds, storages,
    tensor records, allowed globals): a BUILD opcode on one is refused. (A frozen slotted
    dataclass would otherwise get one that rewrites its fields, and the storage kinds are
    shared by every load.)"""
    raise _refused(f"a BUILD of a {type(self).__name__} (changing it)")


@dataclass(frozen=True, slots=True)
class _Kind:
    """A torch storage class: its name, the dtype of its elements, their size in bytes, and
    the NumPy dtype stepgraph holds them in (None: a dtype no stepgraph tensor holds)."""

    storage: str
    dtype: str
    itemsize: int
    numpy: str | None
    __setstate__ = _no_build


_KINDS = {k.storage: k for k in (
    _Kind("FloatStorage", "float32", 4, "float32"),
    _Kind("DoubleStorage", "float64", 8, "float64"),
    _Kind("LongStorage", "int64", 8, "int64"), _Kind("IntStorage", "int32", 4, "int32"),
    _Kind("ByteStorage", "uint8", 1, "uint8"), _Kind("BoolStorage", "bool", 1, "bool"),
    _Kind("BFloat16Storage", BF16, 2, storage_dtype(BF16)),
    _Kind("HalfStorage", "float16", 2, "float16"), _Kind("ShortStorage", "int16", 2, None),
    _Kind("CharStorage", "int8", 1, None), _Kind("ComplexFloatStorage", "complex64", 8, None),
    _Kind("ComplexDoubleStorage", "complex128", 16, None))}
_UNTYPED = _Kind("UntypedStorage", "uint8", 1, "uint8")   # bytes; _rebuild_tensor_v3 types them
_KIND_OF_DTYPE = {k.dtype: k for k in _KINDS.values() if k.numpy is not None}


# ---------------------------------------------------------------------------- save


def save(obj, f, pickle_module=pickle, pickle_protocol: int = 2,
         _use_new_zipfile_serialization: bool = True,
         _disable_byteorder_record: bool = False) -> None:
    """Write `obj` to `f` (a path or a writable binary file object) in torch's zip format,
    which `torch.load` reads (weights_only=True included).

    `obj` may nest dict, OrderedDict, list, tuple, set, numbers, strings, bytes and None
    around eager tensors (`model.state_dict()`'s values), Parameters and Buffers (a Parameter
    loads in torch as nn.Parameter), NumPy arrays and NumPy scalars (saved as Python
    numbers), torch.Size, dtypes and devices. Tensors are written from host memory with
    location "cpu"; an array or tensor saved twice (the same object: a tied parameter in a
    state_dict) is one storage. The pickle is written with protocol 2's opcodes, torch's
    default (`pickle_protocol` is accepted and ignored: any torch reads them); the legacy
    non-zip format is read but not written."""
    if pickle_module is not pickle:
        raise SerializationError("torch.save: stepgraph writes torch's pickle itself; "
                                 f"pickle_module={pickle_module!r} is not supported")
    if not _use_new_zipfile_serialization:
        raise SerializationError("torch.save(_use_new_zipfile_serialization=False): the "
                                 "legacy format is read by stepgraph, not written; save the "
                                 "zip format, which every torch since 1.6 loads")
    writer = _PickleWriter()
    data_pkl = writer.dump(obj)
    if isinstance(f, (str, os.PathLike)):
        with open(f, "wb") as out:
            _write_archive(out, data_pkl, writer.storages, not _disable_byteorder_record)
    elif callable(getattr(f, "write", None)):
        _write_archive(f, data_pkl, writer.storages, not _disable_byteorder_record)
    else:
        raise TypeError(f"torch.save: f must be a path or a writable binary file object, "
                        f"got {type(f).__name__}")


def _tensor_source(obj):
    """(values in storage dtype, kind, saved as a Parameter, requires_grad, the object whose
    identity names its storage) of what torch.save writes as a tensor, or None."""
    if isinstance(obj, Tensor):
        if not obj.is_eager:
            raise SerializationError("torch.save: a traced tensor has no values (save "
                                     "outside forward, e.g. model.state_dict())")
        return obj.array, _KIND_OF_DTYPE[obj.value.dtype], False, False, obj.array
    if isinstance(obj, _Stored):
        return obj.numpy(), _array_kind(obj.storage.dtype), isinstance(obj, Parameter), \
            bool(getattr(obj, "requires_grad", False)), obj.storage
    if isinstance(obj, np.ndarray):
        return obj, _array_kind(obj.dtype), False, False, obj
    if hasattr(obj, "get") and hasattr(obj, "__cuda_array_interface__"):     # CuPy
        return to_numpy(obj), _array_kind(obj.dtype), False, False, obj
    return None


def _array_kind(numpy_dtype) -> _Kind:
    name = np.dtype(numpy_dtype).name
    if name == "uint16":
        raise SerializationError("torch.save: a NumPy uint16 array is ambiguous (stepgraph "
                                 "holds bfloat16 as uint16 bits): save a tensor, e.g. "
                                 "torch.tensor(x).bfloat16() or x.astype(np.int32)")
    if name not in _KIND_OF_DTYPE or name == BF16:
        raise SerializationError(f"torch.save: arrays of {name} are not supported (supported: "
                                 f"{', '.join(k for k in _KIND_OF_DTYPE if k != BF16)})")
    return _KIND_OF_DTYPE[name]


# Pickle opcodes of protocol 2 (Lib/pickletools.py documents each).
_PROTO2, _STOP, _MARK = b"\x80\x02", b".", b"("
_NONE, _TRUE, _FALSE = b"N", b"\x88", b"\x89"
_EMPTY_TUPLE, _TUPLES = b")", {1: b"\x85", 2: b"\x86", 3: b"\x87"}
_TUPLE, _EMPTY_LIST, _APPENDS, _EMPTY_DICT, _SETITEMS = b"t", b"]", b"e", b"}", b"u"
_REDUCE, _BINPERSID, _BINFLOAT, _BINUNICODE = b"R", b"Q", b"G", b"X"


class _PickleWriter:
    """Writes the protocol-2 pickle torch.save writes, for the objects `save` takes.

    Globals are written by name (GLOBAL "module\\nname\\n"), never imported. Lists, dicts
    and globals are memoised (BINPUT / BINGET), so a container reached twice (or holding
    itself) is written once. `storages[key]` holds the bytes of storage `key` (C order,
    little-endian)."""

    def __init__(self):
        self.out = io.BytesIO()
        self.memo: dict = {}                 # id(object) or global name -> memo slot
        self.kept: list = []                 # objects whose id is a key of memo or shared
        self.storages: list[np.ndarray] = []
        self.shared: dict[int, tuple[str, _Kind, int]] = {}    # id(source) -> storage
        self.in_tuples: set[int] = set()

    def dump(self, obj) -> bytes:
        self.out.write(_PROTO2)
        self.save(obj)
        self.out.write(_STOP)
        return self.out.getvalue()

    def save(self, obj) -> None:
        kind = type(obj)
        if obj is None or kind is bool:
            self.out.write(_NONE if obj is None else _TRUE if obj else _FALSE)
        elif kind is int:
            self._int(obj)
        elif kind is float:
            self.out.write(_BINFLOAT + struct.pack(">d", obj))
        elif kind is dtype:
            self._global("torch", str(obj))
        elif kind is str:
            self._str(obj)
        elif kind in (list, dict, OrderedDict) and id(obj) in self.memo:
            self._get(id(obj))
        elif kind is list:
            self._list(obj)
        elif kind in (dict, OrderedDict):
            self._dict(obj)
        elif kind in (tuple, Size, set, complex, bytes, bytearray) or isinstance(obj, device):
            self._value(obj)
        elif isinstance(obj, np.generic):
            self.save(obj.item())             # np.float32(1.5) -> 1.5
        elif (source := _tensor_source(obj)) is not None:
            self._tensor(*source)
        else:
            raise SerializationError(f"torch.save: cannot save a {kind.__module__}."
                                     f"{kind.__qualname__} object: {ONLY_WEIGHTS}, and "
                                     "tensors, Parameters and NumPy arrays save")

    def _value(self, obj) -> None:
        """Tuples and the values written as a call of an allowed global."""
        if isinstance(obj, device):
            self._call("torch", "device", (str(obj),))
        elif isinstance(obj, Size):
            self._call("torch", "Size", (tuple(obj),))
        elif isinstance(obj, tuple):
            self._tuple(obj)
        elif isinstance(obj, set):
            self._call("builtins", "set", (list(obj),))
        elif isinstance(obj, complex):
            self._call("builtins", "complex", (obj.real, obj.imag))
        elif isinstance(obj, bytearray):
            self._call("builtins", "bytearray", (bytes(obj),))
        else:                                 # bytes, as Python's protocol-2 pickler writes
            self._call("_codecs", "encode", (obj.decode("latin1"), "latin1"))

    def _int(self, n: int) -> None:
        if 0 <= n < 256:
            self.out.write(b"K" + bytes([n]))
        elif 0 <= n < 65536:
            self.out.write(b"M" + struct.pack("<H", n))
        elif -2 ** 31 <= n < 2 ** 31:
            self.out.write(b"J" + struct.pack("<i", n))
        else:                                 # LONG1 / LONG4: little-endian two's complement
            data = n.to_bytes((n.bit_length() >> 3) + 1, "little", signed=True)
            self.out.write((b"\x8a" + bytes([len(data)])) if len(data) < 256 else
                           (b"\x8b" + struct.pack("<i", len(data))))
            self.out.write(data)

    def _str(self, s: str) -> None:
        data = s.encode("utf-8", "surrogatepass")
        self.out.write(_BINUNICODE + struct.pack("<I", len(data)) + data)

    def _tuple(self, items: tuple) -> None:
        if id(items) in self.in_tuples:
            raise SerializationError("torch.save: a tuple that contains itself")
        self.in_tuples.add(id(items))
        if not items:
            self.out.write(_EMPTY_TUPLE)
        else:
            self.out.write(b"" if len(items) in _TUPLES else _MARK)
            for item in items:
                self.save(item)
            self.out.write(_TUPLES.get(len(items), _TUPLE))
        self.in_tuples.discard(id(items))

    def _list(self, items: list) -> None:
        self.out.write(_EMPTY_LIST)
        self._put(id(items), items)
        if items:
            self.out.write(_MARK)
            for item in items:
                self.save(item)
            self.out.write(_APPENDS)

    def _dict(self, mapping: dict) -> None:
        if type(mapping) is OrderedDict:
            self._call("collections", "OrderedDict", ())
        else:
            self.out.write(_EMPTY_DICT)
        self._put(id(mapping), mapping)
        if mapping:
            self.out.write(_MARK)
            for key, value in mapping.items():
                self.save(key)
                self.save(value)
            self.out.write(_SETITEMS)

    def _global(self, module: str, name: str) -> None:
        key = f"{module}.{name}"
        if key in self.memo:
            self._get(key)
        else:
            self.out.write(f"c{module}\n{name}\n".encode("ascii"))
            self._put(key, None)

    def _call(self, module: str, name: str, args: tuple) -> None:
        self._global(module, name)
        self._tuple(args)
        self.out.write(_REDUCE)

    def _put(self, key, obj) -> None:
        slot = self.memo[key] = len(self.memo)
        self.kept.append(obj)
        self.out.write(b"q" + bytes([slot]) if slot < 256 else b"r" + struct.pack("<I", slot))

    def _get(self, key) -> None:
        slot = self.memo[key]
        self.out.write(b"h" + bytes([slot]) if slot < 256 else b"j" + struct.pack("<I", slot))

    def _tensor(self, values, kind: _Kind, parameter: bool, requires_grad: bool,
                owner) -> None:
        """_rebuild_tensor_v2(storage, 0, shape, C strides, requires_grad, OrderedDict()),
        inside _rebuild_parameter(tensor, requires_grad, OrderedDict()) for a Parameter."""
        shape = tuple(int(n) for n in np.shape(values))
        if id(owner) not in self.shared:
            flat = np.ascontiguousarray(values, np.dtype(kind.numpy).newbyteorder("<"))
            self.storages.append(flat.reshape(-1))
            self.kept.append(owner)
            self.shared[id(owner)] = (str(len(self.storages) - 1), kind, flat.size)
        key, kind, numel = self.shared[id(owner)]
        strides = tuple(int(np.prod(shape[i + 1:], dtype=np.int64)) for i in range(len(shape)))
        if parameter:
            self._global("torch._utils", "_rebuild_parameter")
            self.out.write(_MARK)
        self._global("torch._utils", "_rebuild_tensor_v2")
        self.out.write(_MARK + _MARK)
        self._str("storage")
        self._global("torch", kind.storage)
        for item in (key, "cpu", numel):
            self.save(item)
        self.out.write(_TUPLE + _BINPERSID)
        for item in (0, shape, strides, requires_grad and not parameter):
            self.save(item)
        self._call("collections", "OrderedDict", ())
        self.out.write(_TUPLE + _REDUCE)
        if parameter:
            self.save(requires_grad)
            self._call("collections", "OrderedDict", ())
            self.out.write(_TUPLE + _REDUCE)


class _Counted:
    """The stream zipfile writes to: counts the bytes (offsets relative to the archive's
    start, for the alignment padding) and has no seek, so zipfile writes each record once,
    followed by a data descriptor, as torch's writer does; pipes and sockets work too."""

    def __init__(self, f):
        self.f = f
        self.written = 0

    def write(self, data) -> int:
        self.f.write(data)
        self.written += memoryview(data).nbytes
        return memoryview(data).nbytes

    def tell(self) -> int:
        return self.written

    def flush(self) -> None:
        if callable(getattr(self.f, "flush", None)):
            self.f.flush()


def _write_archive(f, data_pkl: bytes, storages: list[np.ndarray], byteorder: bool) -> None:
    """The zip archive torch.save writes: data.pkl, the format records, each storage (64-byte
    aligned), version. Stored, not compressed, as torch's."""
    sink = _Counted(f)
    with zipfile.ZipFile(sink, "w", zipfile.ZIP_STORED) as archive:
        records = [("data.pkl", data_pkl), (".format_version", b"1"),
                   (".storage_alignment", str(ALIGNMENT).encode())]
        records += [("byteorder", b"little")] if byteorder else []
        records += [(f"data/{key}", array.view(np.uint8)) for key, array in enumerate(storages)]
        for name, data in records + [("version", b"3\n")]:
            info = zipfile.ZipInfo(f"{ARCHIVE}/{name}", date_time=(1980, 1, 1, 0, 0, 0))
            info.file_size = len(data)
            if name.startswith("data/"):
                info.extra = _padding(sink.tell(), info)
            with archive.open(info, "w") as record:
                record.write(data)


def _padding(offset: int, info: zipfile.ZipInfo) -> bytes:
    """The extra field (id "FB", as torch's writer) that puts a record's data, whose local
    header starts at `offset`, at a multiple of ALIGNMENT. zipfile appends a 20-byte ZIP64
    field after it for records it writes as ZIP64 (its own rule: size * 1.05 over the
    limit)."""
    zip64 = 20 if info.file_size * 1.05 > zipfile.ZIP64_LIMIT else 0
    start = offset + 30 + len(info.filename.encode("utf-8")) + 4 + zip64
    pad = -start % ALIGNMENT
    return b"FB" + struct.pack("<H", pad) + b"Z" * pad


# ---------------------------------------------------------------------------- load


def load(f, map_location=None, pickle_module=None, *, weights_only: bool | None = None,
         mmap: bool | None = None, **pickle_load_args):
    """Read what `torch.save` (torch's zip format or its legacy format) or stepgraph's
    `save` wrote from `f` (a path or a readable binary file object): the saved structure,
    its tensors as stepgraph eager tensors holding copies of the file's values (a saved
    float32 nn.Parameter as an nn.Parameter), so `model.load_state_dict(torch.load(p))`
    works.

    The load is always weights_only: only the globals that rebuild tensors and plain
    containers (dict, OrderedDict, list, tuple, set, numbers, strings, bytes, None,
    torch.Size, dtypes, devices) are accepted, as torch's weights_only unpickler; any other
    global (a class, `os.system` in a hostile `__reduce__`) raises UnsafePickleError naming
    it, and nothing in the file is run. weights_only=False does NOT allow arbitrary objects:
    stepgraph never runs code from a checkpoint. `map_location` (any value torch takes: a
    device, a string, a dict, a callable) and `mmap` are accepted and change nothing: eager
    tensors live in host memory, and where a step runs is `compile_train_step(device=...)`.
    Tensors of dtypes stepgraph tensors cannot hold (int16, int8, complex) raise
    SerializationError; so do big-endian legacy files and TorchScript archives."""
    if pickle_module not in (None, pickle):
        raise SerializationError("torch.load: stepgraph reads checkpoints with its own "
                                 f"weights-only unpickler; pickle_module={pickle_module!r} is "
                                 "not supported")
    unknown = set(pickle_load_args) - {"encoding", "errors"}
    if unknown:
        raise TypeError(f"torch.load: unexpected keyword arguments {sorted(unknown)}")
    pickle_load_args.setdefault("encoding", "utf-8")
    if isinstance(f, (str, os.PathLike)):
        with open(f, "rb") as source:
            return _load_stream(source, pickle_load_args)
    if not callable(getattr(f, "read", None)):
        raise TypeError(f"torch.load: f must be a path or a readable binary file object, "
                        f"got {type(f).__name__}")
    return _load_stream(f, pickle_load_args)


def _load_stream(f, pickle_args: dict):
    if not (callable(getattr(f, "seekable", None)) and f.seekable()):
        f = io.BytesIO(f.read())              # zipfile needs to seek
    start = f.tell()
    head = f.read(4)
    f.seek(start)
    if head == b"PK\x03\x04":
        return _load_zip(f, pickle_args)
    if head[:1] == b"\x80":                   # a pickle: the legacy format's magic number
        return _load_legacy(f, pickle_args)
    raise SerializationError("torch.load: not a file torch.save writes (neither its zip "
                             "format nor its legacy pickle format; the tar format of torch "
                             "before 0.4 is not read)")


def _load_zip(f, pickle_args: dict):
    try:
        archive = zipfile.ZipFile(f)
    except zipfile.BadZipFile as e:
        raise SerializationError(f"torch.load: a corrupt zip archive ({e})") from e
    with archive:
        names = archive.namelist()
        prefix = names[0].split("/", 1)[0] if names else ""
        if f"{prefix}/constants.pkl" in names:
            raise SerializationError("torch.load: a TorchScript archive (torch.jit.save): "
                                     "it holds code, which stepgraph does not load")
        if f"{prefix}/data.pkl" not in names:
            raise SerializationError("torch.load: a zip archive without data.pkl, not a file "
                                     "torch.save writes")
        order = archive.read(f"{prefix}/byteorder") if f"{prefix}/byteorder" in names \
            else b"little"
        if order not in (b"little", b"big"):
            raise SerializationError(f"torch.load: unknown byteorder record {order!r}")

        def read(key: str) -> bytes:
            name = f"{prefix}/data/{key}"
            if name not in names:
                raise SerializationError(f"torch.load: the archive lacks the record {name}")
            return archive.read(name)

        unpickler = _WeightsUnpickler(io.BytesIO(archive.read(f"{prefix}/data.pkl")),
                                      ">" if order == b"big" else "<", **pickle_args)
        result = unpickler.load()
        for storage in unpickler.storages.values():
            storage.data.append(read(storage.key))
    return _finish(result, {})


def _load_legacy(f, pickle_args: dict):
    """The legacy format: magic, protocol, system info, the object, the storage keys (each
    a pickle), then each storage: its element count (8 bytes) and its bytes."""
    def plain():
        return _WeightsUnpickler(f, "<", **pickle_args).load()

    try:
        if plain() != LEGACY_MAGIC:
            raise SerializationError("torch.load: a pickle, but not a file torch.save writes "
                                     "(its legacy format starts with torch's magic number)")
        protocol, info = plain(), plain()
    except UnsafePickleError:
        raise
    except (pickle.UnpicklingError, EOFError, ValueError) as e:
        raise SerializationError(f"torch.load: not a file torch.save writes ({e})") from e
    if protocol != LEGACY_PROTOCOL or type(info) is not dict:
        raise SerializationError(f"torch.load: torch's legacy format of an unknown protocol "
                                 f"{protocol!r}")
    if not info.get("little_endian", True):
        raise SerializationError("torch.load: a big-endian file in torch's legacy format "
                                 "(load it in torch and save it again)")
    unpickler = _WeightsUnpickler(f, "<", **pickle_args)
    result = unpickler.load()
    keys = plain()
    if type(keys) is not list:
        raise SerializationError("torch.load: a legacy file without its list of storages")
    for key in keys:
        storage = unpickler.storages.get(key)
        count = int.from_bytes(f.read(8), "little", signed=True)
        itemsize = storage.kind.itemsize if storage is not None else 1
        data = f.read(max(count, 0) * itemsize)
        if storage is not None:
            storage.data.append(data)
    return _finish(result, {})


@dataclass(frozen=True, slots=True)
class _Storage:
    """A storage a pickle names by persistent id: its kind, key, element count and the byte
    order of its bytes ("<" or ">"); `data` gets its bytes (one bytes object) once the
    archive's record (or the legacy file's tail) is read."""

    kind: _Kind
    key: str
    numel: int
    order: str
    data: list
    __setstate__ = _no_build


@dataclass(frozen=True, slots=True)
class _TensorRecord:
    """A tensor as the pickle describes it: a view (offset, size, stride in elements) of a
    storage whose elements are `kind`'s; made into a tensor by `_finish`."""

    storage: _Storage
    kind: _Kind
    offset: int
    size: tuple
    stride: tuple
    parameter: bool = False
    requires_grad: bool = False
    __setstate__ = _no_build


@dataclass(frozen=True, slots=True)
class _Global:
    """An allowed global as the unpickler hands it to a pickle: calling it calls `call`. It
    is frozen and has no __dict__, so a pickle's BUILD opcode cannot change it."""

    name: str
    call: object
    __setstate__ = _no_build

    def __call__(self, *args):
        return self.call(*args)


def _ints(values, what: str) -> tuple:
    if type(values) not in (tuple, list, Size) or \
            any(type(v) is not int or v < 0 for v in values):
        raise SerializationError(f"torch.load: a tensor record's {what} {values!r} is not a "
                                 "tuple of non-negative ints")
    return tuple(values)


def _record(storage, kind, offset, size, stride, requires_grad) -> _TensorRecord:
    size, stride = _ints(size, "size"), _ints(stride, "stride")
    if type(offset) is not int or offset < 0 or len(size) != len(stride):
        raise SerializationError(f"torch.load: a malformed tensor record (offset {offset!r}, "
                                 f"size {size}, stride {stride})")
    return _TensorRecord(storage, kind, offset, size, stride, False, requires_grad is True)


def _rebuild_tensor_v2(storage, offset, size, stride, requires_grad=False, hooks=None,
                       metadata=None) -> _TensorRecord:
    """torch._utils._rebuild_tensor(_v2): a view of a typed storage. Backward hooks and
    metadata (conj/neg bits of complex tensors) are dropped."""
    if type(storage) is not _Storage:
        raise _refused(f"a tensor rebuilt from a {type(storage).__name__}, not a storage")
    return _record(storage, storage.kind, offset, size, stride, requires_grad)


def _rebuild_tensor_v3(storage, offset, size, stride, requires_grad, hooks, dtype_,
                       metadata=None) -> _TensorRecord:
    """torch._utils._rebuild_tensor_v3: a view of an untyped storage (bytes) whose elements
    are `dtype_`'s (what torch writes for dtypes without a storage class, such as uint16)."""
    if type(storage) is not _Storage or storage.kind is not _UNTYPED or \
            type(dtype_) is not dtype:
        raise SerializationError("torch.load: _rebuild_tensor_v3 takes an UntypedStorage "
                                 "and a dtype")
    kind = _KIND_OF_DTYPE.get(str(dtype_), _Kind("", str(dtype_), 1, None))
    return _record(storage, kind, offset, size, stride, requires_grad)


def _rebuild_parameter(data, requires_grad=True, hooks=None, state=None) -> _TensorRecord:
    """torch._utils._rebuild_parameter(_with_state): the tensor, marked as a Parameter.
    A Parameter's extra Python attributes (`state`) are dropped."""
    if type(data) is not _TensorRecord:
        raise _refused(f"a Parameter of a {type(data).__name__}, not a tensor")
    return _TensorRecord(data.storage, data.kind, data.offset, data.size, data.stride, True,
                         requires_grad is True)


def _encode(text, encoding="utf-8") -> bytes:
    """_codecs.encode, as protocol-2 pickles store bytes: for the encodings they use only
    (another codec name would import that codec's module)."""
    if type(text) is not str or encoding not in ("latin1", "latin-1", "utf-8", "ascii"):
        raise _refused(f"_codecs.encode with {encoding!r}")
    return codecs.encode(text, encoding)


_ALLOWED = {
    "collections.OrderedDict": OrderedDict, "collections.Counter": Counter,
    "builtins.set": set, "builtins.complex": complex, "builtins.bytearray": bytearray,
    "_codecs.encode": _encode, "torch.Size": Size, "torch.device": device,
    "torch._utils._rebuild_tensor": _rebuild_tensor_v2,
    "torch._utils._rebuild_tensor_v2": _rebuild_tensor_v2,
    "torch._utils._rebuild_tensor_v3": _rebuild_tensor_v3,
    "torch._utils._rebuild_parameter": _rebuild_parameter,
    "torch._utils._rebuild_parameter_with_state": _rebuild_parameter,
}
_STORAGES = {f"torch.{name}": kind for name, kind in _KINDS.items()}
_STORAGES.update({"torch.UntypedStorage": _UNTYPED, "torch.storage.UntypedStorage": _UNTYPED})


class _WeightsUnpickler(pickle.Unpickler):
    """Python's unpickler, with find_class limited to `_ALLOWED` (wrapped in `_Global`s),
    torch's storage classes and dtypes; persistent ids name storages (`storages`, by key)
    whose bytes are in byte order `order` ("<" or ">")."""

    def __init__(self, file, order: str, **kwargs):
        super().__init__(file, **kwargs)
        self.order = order
        self.storages: dict[str, _Storage] = {}

    def find_class(self, module: str, name: str):
        # Python's protocol-2 pickler names the builtins by their Python 2 module
        full = f"{'builtins' if module == '__builtin__' else module}.{name}"
        if full in _ALLOWED:
            return _Global(full, _ALLOWED[full])
        if full in _STORAGES:
            return _STORAGES[full]
        if module == "torch" and name in TORCH_DTYPES:
            return dtype(TORCH_DTYPES[name])  # a fresh object: a pickle can change only it
        raise _refused(f"the global {full}")

    def persistent_load(self, pid):
        if type(pid) is not tuple or len(pid) not in (5, 6) or pid[0] != "storage":
            raise _refused(f"the persistent id {pid!r} (torch's name storages only)")
        kind, key, numel = pid[1], pid[2], pid[4]
        if type(kind) is not _Kind or type(key) is not str or type(numel) is not int \
                or numel < 0:
            raise SerializationError(f"torch.load: a malformed storage id {pid!r}")
        if len(pid) == 6 and pid[5] is not None:
            raise SerializationError("torch.load: storage views of torch's pre-1.0 format")
        storage = self.storages.setdefault(key, _Storage(kind, key, numel, self.order, []))
        if storage.kind != kind or storage.numel != numel:
            raise SerializationError(f"torch.load: storage {key} named with two types")
        return storage


def _tensor(record: _TensorRecord):
    """The eager tensor (a float32 Parameter: an nn.Parameter) of a record: the view's
    values copied out of the storage's bytes, bounds checked."""
    kind, storage = record.kind, record.storage
    if kind.numpy is None:
        raise SerializationError(f"torch.load: a tensor of {kind.dtype}: stepgraph tensors "
                                 "hold float32, float64, float16, bfloat16, int64, int32, "
                                 "uint8 and bool (convert it in torch before saving)")
    data = storage.data[0] if storage.data else b""
    nbytes = storage.numel * storage.kind.itemsize
    if len(data) < nbytes:
        raise SerializationError(f"torch.load: storage {storage.key} holds {len(data)} "
                                 f"bytes, its id says {nbytes}")
    flat = np.frombuffer(data, np.dtype(kind.numpy).newbyteorder(storage.order),
                         count=nbytes // kind.itemsize)
    native = np.dtype(kind.numpy)
    if 0 in record.size:
        values = np.empty(record.size, native)
    else:
        last = record.offset + sum((n - 1) * s for n, s in zip(record.size, record.stride))
        if last >= flat.size:
            raise SerializationError(f"torch.load: a view (offset {record.offset}, size "
                                     f"{record.size}, stride {record.stride}) reaches past "
                                     f"its storage of {flat.size} elements")
        view = np.lib.stride_tricks.as_strided(
            flat[record.offset:], record.size, [s * kind.itemsize for s in record.stride],
            writeable=False)
        values = view.astype(native, order="C", copy=True)
    if record.parameter and native == np.float32:
        return Parameter(values, requires_grad=record.requires_grad)
    return tensor_of(values)


_LEAVES = (type(None), bool, int, float, complex, str, bytes)


def _finish(obj, memo: dict):
    """The loaded structure rebuilt from fresh objects of the allowed types: tensor records
    become tensors, containers are copied (a container reached twice stays one object),
    anything else is refused."""
    kind = type(obj)
    if kind in _LEAVES:
        return obj
    if kind is dtype:
        return TORCH_DTYPES[str.__str__(obj)]
    if id(obj) in memo:
        return memo[id(obj)]
    if kind is _TensorRecord:
        out = memo[id(obj)] = _tensor(obj)
    elif kind is list:
        out = memo[id(obj)] = []
        out.extend(_finish(item, memo) for item in obj)
    elif kind in (dict, OrderedDict, Counter):
        out = memo[id(obj)] = kind()
        for key, value in list(obj.items()):
            out[_finish(key, memo)] = _finish(value, memo)
    elif kind in (tuple, Size, set, bytearray):
        out = memo[id(obj)] = kind(_finish(item, memo) for item in obj) if kind is not \
            bytearray else bytearray(obj)
    elif kind is device:
        out = device(obj.type, obj.index)
    else:
        raise _refused(f"a {kind.__module__}.{kind.__qualname__} object in the result")
    return out
