"""torch.utils: its submodules are imported on first use (`torch.utils.checkpoint`)."""


def __getattr__(name: str):
    """A submodule not imported yet, else UnsupportedOpError naming torch.utils.<name>."""
    from ..errors import lookup_torch_name
    return lookup_torch_name(__name__, "torch.utils", name)
