"""The compile pipeline's named passes (build, autocast, fuse, layout, plan, executable, ...).

This package's name is also torch's `torch.compile` in the torch namespace stepgraph gives a
script (`import stepgraph as torch`): the package is callable and calling it is
loop/torch_compile.py's compile, so `torch.compile(model)` and `import stepgraph.compile.plan`
both work."""
import sys
import types

from ..loop.torch_compile import compile as _torch_compile


class _CallablePackage(types.ModuleType):
    def __call__(self, *args, **kwargs):
        return _torch_compile(*args, **kwargs)


sys.modules[__name__].__class__ = _CallablePackage
