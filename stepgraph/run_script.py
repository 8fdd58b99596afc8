"""`stepgraph run script.py [args...]`: a PyTorch training script run unchanged, with `torch`
resolved to stepgraph.

While a run is active, an import hook (TorchFinder, first on sys.meta_path) answers every
`import torch...`: `torch` is the `stepgraph` module itself and `torch.X.Y` the module object
`stepgraph.X.Y` (`torch.nn is stepgraph.nn`), for the torch packages stepgraph stands for
(TORCH_PACKAGES). A torch module stepgraph lacks (`torch.distributions`,
`torch.utils.tensorboard`) raises ModuleNotFoundError naming it; other packages (torchvision,
...) are left to the ordinary import system.

The script runs as Python runs one: `sys.argv = [script, *args]`, its folder first on
sys.path, executed as `__main__` (runpy.run_path), SystemExit's code as the exit code, an
uncaught exception printed through sys.excepthook without the runner's frames (exit code 1).

A real torch already imported in the process (run() called from Python) is put aside for the
run: its `torch` and `torch.*` entries of sys.modules are taken out and put back afterwards,
so code that imported it keeps working once the run is over (code running on other threads
during the run would import stepgraph). After the run sys.modules forgets the modules the
run itself bound to the stand-in torch: those loaded from the script's folder and those that
hold stepgraph modules, so that later code (or a second run) imports them afresh.

Every torch name the script asks for and stepgraph refuses (errors.missing_torch_name: the
module `__getattr__` of each torch-namespace package, and the import hook) is recorded,
without changing the error raised. At the end of a run (after an error too) each is printed
as `stepgraph run: torch.foo is not supported (use ...)`. Names the script only probed
(`hasattr(torch, "foo")`, `getattr(torch, "foo", None)`: a refusal asked for by a call of a
builtin that the script went on from) are printed apart, on one line, since a probe is how a
script checks for a feature and picks another path. Lookups made by stepgraph's own code are
not the script's and are not recorded. Tensor methods a traced tensor refuses (Tensor.foo)
raise their own UnsupportedOpError and are not listed here: their traceback names them.
"""
from __future__ import annotations

import dis
import importlib
import importlib.abc
import importlib.machinery
import os
import runpy
import sys
import types
from contextlib import contextmanager
from dataclasses import dataclass, field

from . import errors

USAGE = "usage: stepgraph run [-h] SCRIPT.py [ARGS ...]"
HELP = f"""{USAGE}

Run a PyTorch training script unchanged, with `import torch` (and torch.nn, torch.optim,
torch.utils.data, ...) resolved to stepgraph. ARGS are the script's own (sys.argv[1:]). The
exit code is the script's; torch names it met that stepgraph does not support are listed at
the end (docs/TORCH_COMPAT.md, "Running a script unchanged")."""

# The torch packages stepgraph stands for: `torch.X...` maps to `stepgraph.X...` under these
# only, so that stepgraph's own packages (ir, ops, compile, data, loop, ...) never pass for
# torch modules of the same name (torch.ops is something else).
TORCH_PACKAGES = ("nn", "optim", "utils", "amp", "cuda", "backends", "distributed",
                  "serialization", "return_types", "version")

# Import attributes module_from_spec writes onto the object a loader creates: put back after,
# since that object is a stepgraph module (or a flags namespace) that keeps its own.
_MODULE_ATTRS = ("__name__", "__loader__", "__package__", "__spec__", "__path__", "__file__",
                 "__cached__")


def is_torch_name(name: str) -> bool:
    return name == "torch" or name.startswith("torch.")


def stepgraph_object(torch_name: str):
    """What `torch_name` ("torch", "torch.nn.functional", "torch.backends.cudnn") imports as:
    the stepgraph module, or a flags namespace standing for a torch module (backends.cudnn).
    ModuleNotFoundError naming the torch module when stepgraph has none."""
    import stepgraph

    if torch_name == "torch":
        return stepgraph
    rest = torch_name[len("torch."):]
    if rest.split(".")[0] in TORCH_PACKAGES:
        name = f"stepgraph.{rest}"
        found = sys.modules.get(name)
        if found is not None:
            return found
        parent_name, _, leaf = name.rpartition(".")
        parent = importlib.import_module(parent_name)
        value = vars(parent).get(leaf)
        if _stands_for_module(value):
            return value
        if hasattr(parent, "__path__") and \
                importlib.machinery.PathFinder.find_spec(name, parent.__path__) is not None:
            return importlib.import_module(name)
    # Through errors.missing_torch_name, so a run records the refusal as any other.
    refusal = errors.missing_torch_name(torch_name)
    raise ModuleNotFoundError(str(refusal), name=torch_name)


def _stands_for_module(value) -> bool:
    from .backends.flags import Flags

    return isinstance(value, Flags) or (isinstance(value, types.ModuleType)
                                        and value.__name__.startswith("stepgraph"))


class AliasLoader(importlib.abc.Loader):
    """Loads `torch_name` as an existing stepgraph object: the same object, its own import
    attributes (__name__, __spec__, ...) kept."""

    def __init__(self, torch_name: str, target):
        self.torch_name, self.target = torch_name, target
        self._saved: dict = {}

    def create_module(self, spec):
        attrs = vars(self.target)
        self._saved = {k: attrs[k] for k in _MODULE_ATTRS if k in attrs}
        return self.target

    def exec_module(self, module) -> None:
        attrs = vars(module)
        for k in _MODULE_ATTRS:
            if k in self._saved:
                attrs[k] = self._saved[k]
            else:
                attrs.pop(k, None)
        # Submodules registered without a package path (stepgraph.cuda.amp, cuda being a
        # module): `import torch.cuda.amp` finds them in sys.modules once the parent loads.
        own = getattr(module, "__name__", None)
        if own is not None and not hasattr(module, "__path__"):
            for k, v in list(attrs.items()):
                if isinstance(v, types.ModuleType) and sys.modules.get(f"{own}.{k}") is v:
                    sys.modules.setdefault(f"{self.torch_name}.{k}", v)


class TorchFinder(importlib.abc.MetaPathFinder):
    """`import torch...` -> the stepgraph module objects (stepgraph_object)."""

    def find_spec(self, fullname, path=None, target=None):
        if not is_torch_name(fullname):
            return None
        found = stepgraph_object(fullname)
        return importlib.machinery.ModuleSpec(fullname, AliasLoader(fullname, found),
                                              is_package=hasattr(found, "__path__"))


# ---- the refusals of a run ----

@dataclass
class Refusals:
    """The torch names refused during a run, in the order first asked for: `used` those the
    script met (attribute access, import, a refusal raised), `probed` those it only asked
    for through hasattr / getattr (a builtin call) and went on from."""

    used: dict[str, str | None] = field(default_factory=dict)      # name -> alternative
    probed: dict[str, str | None] = field(default_factory=dict)
    # the latest error of each probed name, to tell a probe that ended the run
    _probe_errors: dict[str, BaseException] = field(default_factory=dict)

    def note(self, name: str, how: str | None, error: BaseException) -> None:
        if how is None:                  # stepgraph's own lookup, not the script's
            return
        alternative = errors.ALTERNATIVES.get(name)
        if how == "used":
            self.used.setdefault(name, alternative)
            self.probed.pop(name, None)
        elif name not in self.used:
            self.probed.setdefault(name, alternative)
            self._probe_errors[name] = error

    def ended_with(self, exc: BaseException | None) -> None:
        """A probe whose refusal ended the run (getattr without a default) was met."""
        seen = set()
        while exc is not None and id(exc) not in seen:
            seen.add(id(exc))
            for name, error in list(self._probe_errors.items()):
                if error is exc:
                    self.note(name, "used", error)
            exc = exc.__cause__ or exc.__context__
        self._probe_errors.clear()        # their tracebacks hold the script's frames

    def lines(self) -> list[str]:
        out = [f"stepgraph run: {name} is not supported" + (f" (use {alt})" if alt else "")
               for name, alt in self.used.items()]
        if self.probed:
            out.append("stepgraph run: probed (hasattr / getattr) and not supported: "
                       + ", ".join(self.probed))
        return out


_CALLS: dict[types.CodeType, dict[int, bool]] = {}   # code -> offset -> is a call


def _is_call(frame) -> bool:
    """Is the instruction `frame` is executing a call (of hasattr / getattr, a builtin:
    a Python function would have its own frame)?"""
    code = frame.f_code
    calls = _CALLS.get(code)
    if calls is None:
        calls = _CALLS[code] = {i.offset: i.opname.startswith(("CALL", "PRECALL"))
                                for i in dis.get_instructions(code)}
    return calls.get(frame.f_lasti, False)


def how_asked(frame) -> str | None:
    """How the refusal made in `frame` (errors.missing_torch_name's caller) was asked for:
    "used", "probed", or None for a lookup by stepgraph's own code."""
    while frame is not None and frame.f_globals.get("__name__") == errors.__name__:
        frame = frame.f_back                         # lookup_torch_name
    if frame is None or frame.f_code.co_name != "__getattr__":
        return "used"                                # raised as a refusal, not a lookup
    asker = frame.f_back
    if asker is None:
        return "used"
    module = asker.f_globals.get("__name__") or ""
    if module == "stepgraph" or module.startswith("stepgraph."):
        return None
    return "probed" if _is_call(asker) else "used"


@contextmanager
def recording(refusals: Refusals):
    """errors.missing_torch_name records into `refusals`; the error it returns is unchanged."""
    original = errors.missing_torch_name

    def missing_torch_name(torch_name: str) -> errors.UnsupportedOpError:
        error = original(torch_name)
        try:
            how = how_asked(sys._getframe(1))
        except Exception:                 # never let the record change the error
            how = "used"
        refusals.note(torch_name, how, error)
        return error

    errors.missing_torch_name = missing_torch_name
    try:
        yield refusals
    finally:
        errors.missing_torch_name = original


@contextmanager
def torch_is_stepgraph(script_dir: str):
    """`import torch` resolves to stepgraph inside; sys.modules as it was after (a real torch
    put back; what the run bound to the stand-in forgotten: see the module docstring)."""
    import stepgraph

    before = set(sys.modules)
    shelved = {k: sys.modules.pop(k) for k in list(sys.modules) if is_torch_name(k)}
    finder = TorchFinder()
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        sys.meta_path[:] = [f for f in sys.meta_path if f is not finder]
        for k in [k for k in sys.modules if is_torch_name(k)]:
            del sys.modules[k]
        sys.modules.update(shelved)
        stand_ins = {id(stepgraph)} | {id(m) for k, m in sys.modules.items()
                                       if k.startswith("stepgraph.")}
        for k in [k for k in sys.modules if k not in before]:
            if not k.startswith("stepgraph") and \
                    _bound_to_run(sys.modules[k], script_dir, stand_ins):
                del sys.modules[k]


def _bound_to_run(module, script_dir: str, stand_ins: set[int]) -> bool:
    path = getattr(module, "__file__", None)
    if path and os.path.abspath(path).startswith(script_dir + os.sep):
        return True
    try:
        return any(id(v) in stand_ins for v in vars(module).values())
    except TypeError:                    # an object without __dict__ in sys.modules
        return False


# ---- running the script ----

@dataclass(frozen=True)
class RunResult:
    exit_code: int
    refusals: Refusals


def run_script(path: str, argv=()) -> RunResult:
    """Run the script at `path` with sys.argv[1:] = argv and torch resolved to stepgraph;
    its exit code and the torch names refused (nothing printed but the script's own output
    and, for an uncaught exception, its traceback)."""
    refusals = Refusals()
    path = os.fspath(path)
    if not os.path.exists(path):
        print(f"stepgraph run: can't open file {os.path.abspath(path)!r}: [Errno 2] No such "
              "file or directory", file=sys.stderr)
        return RunResult(2, refusals)
    script_dir = os.path.dirname(os.path.abspath(path))
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = [path, *map(str, argv)]
    sys.path.insert(0, script_dir)
    error = None
    try:
        with recording(refusals), torch_is_stepgraph(script_dir):
            try:
                runpy.run_path(path, run_name="__main__")
                code = 0
            except SystemExit as exit_:
                code = _exit_status(exit_.code)
            except BaseException as exc:       # KeyboardInterrupt too, as Python reports it
                error = exc
                _print_traceback(exc)
                code = 130 if isinstance(exc, KeyboardInterrupt) else 1
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
    refusals.ended_with(error)
    return RunResult(code, refusals)


def run(path: str, argv=()) -> int:
    """`stepgraph run`: run the script (run_script), then print the torch names it met that
    stepgraph does not support, one line each on stderr; the script's exit code."""
    result = run_script(path, argv)
    sys.stdout.flush()
    for line in result.refusals.lines():
        print(line, file=sys.stderr)
    return result.exit_code


def _exit_status(code) -> int:
    """sys.exit(code)'s exit status, as Python's: None 0, an int itself, else printed, 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    sys.stdout.flush()
    print(code, file=sys.stderr)
    return 1


def _print_traceback(exc: BaseException) -> None:
    """The traceback Python prints for an uncaught exception of the script: from the script's
    own frame on (runpy's and the runner's left out), through sys.excepthook."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_globals.get("__name__") in ("runpy", __name__):
        tb = tb.tb_next
    sys.stdout.flush()
    # the default hook prints the exception's own __traceback__, not its argument
    sys.excepthook(type(exc), exc.with_traceback(tb), tb)


def main(argv: list[str]) -> int:
    """The `run` command: `SCRIPT.py [ARGS ...]` (everything after the script is its own)."""
    if not argv:
        print(f"{USAGE}\nstepgraph run: error: the script to run is missing", file=sys.stderr)
        return 2
    if argv[0] in ("-h", "--help"):
        print(HELP)
        return 0
    return run(argv[0], argv[1:])
