"""The torch names model-zoo files reach for besides tensor ops: torch.fx.wrap, torch.jit's
queries and decorators, torch._assert, torch.meshgrid (eager and traced, with gradients,
against torch in float64), torch.autograd.Variable and the refusals around them, and
torch.utils.checkpoint (the same training bit for bit, and a smaller arena)."""
from __future__ import annotations

import numpy as np
import pytest
import torch as real

import stepgraph as torch
from stepgraph import nn, optim
from stepgraph.errors import UnsupportedOpError
from tests.ops.helpers import forward_and_grads, torch_forward_and_grads


# ---- torch.fx, torch.jit ---------------------------------------------------------------------

def test_fx_wrap_is_identity_and_symbolic_trace_is_refused():
    def helper(x):
        return x + 1
    assert torch.fx.wrap("len") == "len"
    assert torch.fx.wrap(helper) is helper
    with pytest.raises(UnsupportedOpError, match="torch.fx.symbolic_trace.*compile_train_step"):
        torch.fx.symbolic_trace(nn.Linear(2, 2))
    with pytest.raises(UnsupportedOpError, match="torch.fx.GraphModule"):
        torch.fx.GraphModule
    assert not hasattr(torch.fx, "Proxy")


def test_jit_queries_and_decorators_mean_the_python_code():
    assert torch.jit.is_scripting() is False and torch.jit.is_tracing() is False

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(3, 2)

        @torch.jit._overload_method  # noqa: F811
        def forward(self, x):  # type: (int) -> int
            pass

        def forward(self, x):  # noqa: F811
            if torch.jit.is_scripting():
                raise RuntimeError("not taken")
            return self.helper(self.fc(x))

        @torch.jit.unused
        def helper(self, x):
            return self.exported(x) * 2

        @torch.jit.ignore
        def exported(self, x):
            return self.dropped(x)

        @torch.jit.ignore(drop=True)
        def dropped(self, x):
            return self.kept(x)

        @torch.jit.export
        def kept(self, x):
            return x + 1

    net = Net()
    assert torch.jit.script(net) is net
    assert torch.jit.trace(net, (torch.ones(1, 3),)) is net
    x = np.ones((4, 3), np.float32)
    y = torch.compile_predict(net, (x,))(x)
    w, b = net.fc.weight.numpy(), net.fc.bias.numpy()
    np.testing.assert_allclose(y, (x @ w.T + b + 1) * 2, rtol=1e-6)
    assert torch.jit.annotate(list, [1]) == [1]
    with pytest.raises(UnsupportedOpError, match="torch.jit.save.*state_dict"):
        torch.jit.save(net, "x.pt")


def test_assert_checks_bools_at_trace_time_and_passes_traced_conditions():
    torch._assert(True, "fine")
    with pytest.raises(AssertionError, match="bad shape"):
        torch._assert(3 == 4, "bad shape")
    with pytest.raises(AssertionError, match="eager"):
        torch._assert(torch.tensor(False), "eager")

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(3, 2)

        def forward(self, x):
            torch._assert(x.dim() == 2, "x must be 2-d")
            torch._assert(x.sum() > 0, "a traced condition is not checked")
            return self.fc(x)

    x = -np.ones((4, 3), np.float32)
    torch.compile_predict(Net(), (x,))(x)
    with pytest.raises(AssertionError, match="x must be 2-d"):
        torch.compile_predict(Net(), (x[None],))


# ---- torch.meshgrid -----------------------------------------------------------------------------

@pytest.mark.parametrize("indexing", ["ij", "xy", None])
def test_meshgrid_eager_equals_torch(indexing):
    a, b, c = np.arange(3), np.arange(4) * 2, np.arange(2) - 5
    kwargs = {} if indexing is None else {"indexing": indexing}
    ours = torch.meshgrid(torch.tensor(a), torch.tensor(b), torch.tensor(c), **kwargs)
    theirs = real.meshgrid(real.tensor(a), real.tensor(b), real.tensor(c),
                           indexing=indexing or "ij")
    for o, t in zip(ours, theirs):
        np.testing.assert_array_equal(o.numpy(), t.numpy())
    ours = torch.meshgrid([torch.tensor(a), torch.tensor(b)], **kwargs)
    assert ours[0].shape == real.meshgrid(real.tensor(a), real.tensor(b),
                                          indexing=indexing or "ij")[0].shape


@pytest.mark.parametrize("indexing", ["ij", "xy"])
def test_meshgrid_traced_forward_and_gradients_equal_torch(indexing):
    rng = np.random.default_rng(3)
    arrays = {"a": rng.standard_normal(3), "b": rng.standard_normal(5)}
    arrays["target"] = rng.standard_normal((5, 3) if indexing == "xy" else (3, 5))

    def ours(tracer, t):
        ga, gb = torch.meshgrid(t["a"], t["b"], indexing=indexing)
        return ga * gb + ga.exp()

    def theirs(a, b):
        ga, gb = real.meshgrid(a, b, indexing=indexing)
        return ga * gb + ga.exp()

    y, grads = forward_and_grads(ours, arrays, ("a", "b"), fused=False)
    ty, tgrads = torch_forward_and_grads(theirs, arrays, ("a", "b"))
    np.testing.assert_allclose(y, ty, rtol=1e-13)
    for k in grads:
        np.testing.assert_allclose(grads[k], tgrads[k], rtol=1e-12)


# ---- torch.autograd --------------------------------------------------------------------------

def test_variable_is_identity_and_the_rest_of_autograd_is_refused():
    from torch.autograd import Variable  # the file's import line, as written for torch
    del Variable
    t = torch.ones(2, 3)
    assert torch.autograd.Variable(t) is t
    assert torch.autograd.Variable(t, requires_grad=True) is t
    v = torch.autograd.Variable([1.0, 2.0])
    np.testing.assert_array_equal(v.numpy(), [1.0, 2.0])
    assert isinstance(t, torch.autograd.Variable) and not isinstance(3, torch.autograd.Variable)
    with torch.autograd.no_grad():
        pass
    with pytest.raises(UnsupportedOpError, match="torch.autograd.grad.*compile_train_step"):
        torch.autograd.grad
    assert not hasattr(torch.autograd, "Function")


# ---- torch.utils.checkpoint ----------------------------------------------------------------

class Tower(nn.Module):
    """Linear (+ BatchNorm1d) + GELU + Dropout blocks, optionally each under checkpoint."""

    def __init__(self, checkpointed: bool, width: int = 64, depth: int = 6, norm=False):
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, width), nn.BatchNorm1d(width) if norm else
                          nn.Identity(), nn.GELU(), nn.Dropout(0.2))
            for _ in range(depth))
        self.head = nn.Linear(width, 10)
        self.checkpointed = checkpointed

    def forward(self, x):
        from stepgraph.utils.checkpoint import checkpoint
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.checkpointed else block(x)
        return self.head(x)


def _train(checkpointed: bool, steps: int = 3, norm: bool = False):
    torch.manual_seed(0)
    model = Tower(checkpointed, norm=norm)
    rng = np.random.default_rng(0)
    xs = rng.standard_normal((steps, 512, 64)).astype(np.float32)
    ys = rng.integers(0, 10, (steps, 512))
    step = torch.compile_train_step(model, torch.nn.functional.cross_entropy,
                                    optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                    (xs[0], ys[0]), seed=5)
    losses = [float(step(x, y)) for x, y in zip(xs, ys)]
    arena = next(iter(step.executables.values())).plan.arena_bytes
    return losses, {k: v.clone() for k, v in model.state_dict().items()}, arena


@pytest.mark.parametrize("norm", [False, True])
def test_checkpoint_trains_bit_for_bit_with_a_smaller_arena(norm):
    plain_losses, plain_state, plain_arena = _train(False, norm=norm)
    losses, state, arena = _train(True, norm=norm)
    assert losses == plain_losses
    for k in plain_state:
        np.testing.assert_array_equal(state[k], plain_state[k])
    # each block keeps only its input into the backward: its GELU input and dropout mask are
    # recomputed there instead (measured without norm: 1.34 MB against 2.03 MB); BatchNorm
    # (it updates its running statistics in place) is not recomputed: its output is kept
    # (measured with it: 1.88 MB against 2.87 MB)
    assert arena < 0.75 * plain_arena, (arena, plain_arena)


def test_checkpoint_outside_a_train_trace_runs_the_function():
    from stepgraph.utils import checkpoint as cp
    seq = nn.Sequential(nn.Linear(3, 3), nn.ReLU(), nn.Linear(3, 2), nn.Tanh())
    x = torch.ones(2, 3)
    np.testing.assert_array_equal(cp.checkpoint(seq, x, use_reentrant=True).numpy(),
                                  seq(x).numpy())
    np.testing.assert_array_equal(cp.checkpoint_sequential(seq, 2, x).numpy(),
                                  seq(x).numpy())
    xs = np.ones((2, 3), np.float32)
    model = nn.Sequential(seq)
    model.forward = lambda x: cp.checkpoint(seq, x)
    np.testing.assert_allclose(torch.compile_predict(model, (xs,))(xs), seq(x).numpy(),
                               rtol=1e-6)
