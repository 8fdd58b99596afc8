"""A 2-layer GPT (nanoGPT's structure) against PyTorch: a PyTorch state_dict loads and gives
the same logits; 20 AdamW steps with parameter groups (weight decay on matrices only),
betas (0.9, 0.99) and gradient clipping give the same losses and parameters; the tied
token embedding / classifier weight is one parameter, updated once.

The model is defined here with stepgraph's nn (and mirrored in torch), and the same checks
run on stepgraph.models.gpt, the packaged GPT.
"""
from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
import torch.nn as tnn
import torch.nn.functional as TF

import stepgraph as sg
from stepgraph import models, nn, optim
from stepgraph.compile.build import build_train_graph
from stepgraph.compile.feed import signature_of
from stepgraph.nn import functional as F

VOCAB, BLOCK, LAYERS, HEADS, EMBD = 17, 16, 2, 2, 32
BATCH, T = 4, 15                     # T < BLOCK and odd: positions are a prefix of wpe
STEPS, LR, BETAS, WD, CLIP = 20, 3e-3, (0.9, 0.99), 0.1, 1.0
IGNORE = -1                          # nanoGPT's ignore_index; some targets use it


# ---- the model, in stepgraph ---------------------------------------------------------------

class CausalSelfAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_attn = nn.Linear(EMBD, 3 * EMBD)
        self.c_proj = nn.Linear(EMBD, EMBD)

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(EMBD, dim=2)
        q, k, v = (t.view(B, T, HEADS, C // HEADS).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_fc = nn.Linear(EMBD, 4 * EMBD)
        self.gelu = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(4 * EMBD, EMBD)

    def forward(self, x):
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(EMBD), CausalSelfAttention()
        self.ln_2, self.mlp = nn.LayerNorm(EMBD), MLP()

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Transformer(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, EMBD), nn.Embedding(BLOCK, EMBD)
        self.h = nn.ModuleList([Block() for _ in range(LAYERS)])
        self.ln_f = nn.LayerNorm(EMBD)


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.transformer = Transformer()
        self.lm_head = nn.Linear(EMBD, VOCAB, bias=False)
        self.transformer.wte.weight = self.lm_head.weight      # weight tying, as nanoGPT

    def forward(self, idx):
        t = self.transformer
        x = t.wte(idx) + t.wpe(sg.arange(idx.size(1)))
        for block in t.h:
            x = block(x)
        return self.lm_head(t.ln_f(x))


def loss_fn(logits, targets):
    return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1),
                           ignore_index=IGNORE)


# ---- the same model in torch (nanoGPT's code, dropout 0) -----------------------------------
# Alike the stepgraph model above on purpose: the trajectories of the two are compared.

class TorchAttention(tnn.Module):
    def __init__(self):
        super().__init__()
        self.c_attn, self.c_proj = tnn.Linear(EMBD, 3 * EMBD), tnn.Linear(EMBD, EMBD)

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(EMBD, dim=2)
        q, k, v = (t.view(B, T, HEADS, C // HEADS).transpose(1, 2) for t in (q, k, v))
        y = TF.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class TorchBlock(tnn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1, self.attn, self.ln_2 = tnn.LayerNorm(EMBD), TorchAttention(), tnn.LayerNorm(EMBD)
        self.mlp = tnn.ModuleDict(dict(c_fc=tnn.Linear(EMBD, 4 * EMBD),
                                       gelu=tnn.GELU(approximate="tanh"),
                                       c_proj=tnn.Linear(4 * EMBD, EMBD)))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        m = self.mlp
        return x + m.c_proj(m.gelu(m.c_fc(self.ln_2(x))))


class TorchGPT(tnn.Module):
    def __init__(self):
        super().__init__()
        self.transformer = tnn.ModuleDict(dict(
            wte=tnn.Embedding(VOCAB, EMBD), wpe=tnn.Embedding(BLOCK, EMBD),
            h=tnn.ModuleList([TorchBlock() for _ in range(LAYERS)]), ln_f=tnn.LayerNorm(EMBD)))
        self.lm_head = tnn.Linear(EMBD, VOCAB, bias=False)
        self.transformer.wte.weight = self.lm_head.weight
        for name, p in self.named_parameters():              # GPT-2's initialisation
            if name.endswith("c_proj.weight"):
                tnn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * LAYERS))
            elif name.endswith(".weight") and p.dim() == 2:
                tnn.init.normal_(p, 0.0, 0.02)
            elif name.endswith(".bias"):
                tnn.init.normal_(p, 0.0, 0.02)          # non-zero: their gradients matter

    def forward(self, idx):
        t = self.transformer
        x = t.wte(idx) + t.wpe(torch.arange(idx.size(1)))
        for block in t.h:
            x = block(x)
        return self.lm_head(t.ln_f(x))


def torch_loss(logits, targets):
    return TF.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1),
                            ignore_index=IGNORE)


# ---- helpers -------------------------------------------------------------------------------

def packaged_gpt():
    return models.gpt(VOCAB, block_size=BLOCK, n_layer=LAYERS, n_head=HEADS, n_embd=EMBD,
                      dropout=0.0)


MODELS = pytest.mark.parametrize("make_model", [GPT, packaged_gpt], ids=["test-gpt", "models"])


def torch_gpt(seed: int = 0) -> TorchGPT:
    torch.manual_seed(seed)
    return TorchGPT()


def load_torch(model: nn.Module, tmodel: tnn.Module) -> None:
    model.load_state_dict({k: v.detach().numpy() for k, v in tmodel.state_dict().items()})


def batches(seed: int = 0):
    """STEPS batches of (tokens, next tokens) of a learnable text (each token the previous
    plus 1 or 2, mod VOCAB, the stride fixed per sequence), some targets ignored."""
    gen = np.random.default_rng(seed)
    out = []
    for i in range(STEPS):
        start = gen.integers(0, VOCAB, (BATCH, 1))
        seq = (start + gen.integers(1, 3, (BATCH, 1)) * np.arange(T + 1)) % VOCAB
        x, y = seq[:, :-1].copy(), seq[:, 1:].copy()
        if i % 3 == 0:
            y[gen.integers(0, BATCH), gen.integers(0, T, 3)] = IGNORE
        out.append((x, y))
    return out


def groups(named):
    """nanoGPT's groups: decay on parameters of >= 2 dims (each parameter once)."""
    ps = [p for _, p in named]
    dims = (lambda p: p.dim()) if ps and isinstance(ps[0], torch.Tensor) else \
        (lambda p: len(p.shape))
    return [{"params": [p for p in ps if dims(p) >= 2], "weight_decay": WD},
            {"params": [p for p in ps if dims(p) < 2], "weight_decay": 0.0}]


def torch_trajectory(tmodel: tnn.Module, data):
    """Losses, final parameters and how many steps clipped, training `tmodel` in place."""
    opt = torch.optim.AdamW(groups(tmodel.named_parameters()), lr=LR, betas=BETAS)
    losses, clipped = [], 0
    for x, y in data:
        opt.zero_grad()
        loss = torch_loss(tmodel(torch.tensor(x)), torch.tensor(y))
        loss.backward()
        clipped += float(tnn.utils.clip_grad_norm_(tmodel.parameters(), CLIP)) > CLIP
        opt.step()
        losses.append(loss.item())
    return np.array(losses), {k: v.detach().double().numpy()
                              for k, v in tmodel.state_dict().items()}, clipped


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))


# ---- tests ---------------------------------------------------------------------------------

@MODELS
def test_parameter_names_and_state_dict_keys_match_torch(make_model):
    model, tmodel = make_model(), torch_gpt()
    assert list(model.state_dict()) == list(tmodel.state_dict())     # both tied keys
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in tmodel.named_parameters()]
    assert "lm_head.weight" not in dict(model.named_parameters())
    assert len(list(model.named_parameters(remove_duplicate=False))) == \
        len(list(tmodel.named_parameters(remove_duplicate=False)))


@MODELS
def test_torch_state_dict_loads_and_gives_the_same_logits(make_model):
    model, tmodel = make_model(), torch_gpt(seed=1)
    load_torch(model, tmodel)
    assert model.lm_head.weight is model.transformer.wte.weight      # still tied
    x = np.random.default_rng(2).integers(0, VOCAB, (3, BLOCK))
    predict = sg.compile_predict(model, (x,))
    logits = np.asarray(predict(x))
    want = tmodel(torch.tensor(x)).detach().numpy()
    assert logits.shape == (3, BLOCK, VOCAB)
    np.testing.assert_allclose(logits, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    short = x[:, :5]                                                 # T < block_size
    np.testing.assert_allclose(np.asarray(sg.compile_predict(model, (short,))(short)),
                               tmodel(torch.tensor(short)).detach().numpy(), rtol=1e-5,
                               atol=1e-5 * np.abs(want).max())


@MODELS
def test_twenty_adamw_steps_with_groups_and_clipping_match_torch(make_model):
    """Tolerance: stepgraph runs float32 like torch's float32 run, with sums in other orders,
    so their trajectories differ by float32 rounding grown over 20 Adam steps. Measured
    against a float64 torch run of the same steps (the exact trajectory), stepgraph must be
    as close as torch's own float32 run is, up to a factor 4 (plus 1e-6 relative) for the
    rounding of different summation orders."""
    data = batches()
    tmodel = torch_gpt()
    model = make_model()
    load_torch(model, tmodel)
    t64 = copy.deepcopy(tmodel).double()
    assert t64.lm_head.weight is t64.transformer.wte.weight
    want32, params32, clipped = torch_trajectory(tmodel, data)
    want64, params64, _ = torch_trajectory(t64, data)
    assert 0 < clipped < STEPS                    # clipping active on some steps, not all

    opt = optim.AdamW(groups(model.named_parameters()), lr=LR, betas=BETAS,
                      max_grad_norm=CLIP)
    step = sg.compile_train_step(model, loss_fn, opt, data[0])
    losses = np.array([float(step(x, y)) for x, y in data])

    assert losses[-1] < losses[0] - 0.1                               # it learns
    loss_err, torch_loss_err = (np.abs(v - want64).max() for v in (losses, want32))
    assert loss_err <= 4 * torch_loss_err + 1e-6 * abs(want64).max(), (losses, want64)
    final = model.state_dict()
    for key, want in params64.items():
        err, torch_err = rel(final[key], want), rel(params32[key], want)
        assert err <= 4 * torch_err + 1e-6, f"{key}: {err:.2e} vs torch float32 {torch_err:.2e}"
    np.testing.assert_allclose(losses, want32, rtol=1e-4)            # and plainly close


@MODELS
def test_tied_weight_is_one_parameter_updated_once(make_model):
    model = make_model()
    x, y = batches()[0]
    opt = optim.AdamW(groups(model.named_parameters()), lr=LR, betas=BETAS)
    graph = build_train_graph(model, loss_fn, opt, signature_of(("x", "y"), (x, y)), seed=0)
    names = [v.name for v in graph.params]
    assert "transformer.wte.weight" in names and "lm_head.weight" not in names
    assert len(names) == len(set(names)) == len(list(model.named_parameters()))
    (update,) = [n for n in graph.nodes if n.op == "adam_update"]
    assert update.attrs["n_params"] == len(names)
    table = opt.hyperparameter_table(opt.emitted_rows())   # lr, weight_decay, beta1, ...
    assert [p.name for p in opt.emitted_rows()] == names
    decays = dict(zip(names, table[:, 1]))
    assert decays["transformer.wte.weight"] == WD and decays["transformer.ln_f.weight"] == 0.0
    assert (table[:, 0] == LR).all() and (table[:, 2] == BETAS[0]).all()

    before = model.state_dict()
    step = sg.compile_train_step(model, loss_fn, opt, (x, y))
    step(x, y)
    after = model.state_dict()
    np.testing.assert_array_equal(after["lm_head.weight"], after["transformer.wte.weight"])
    assert not np.array_equal(after["lm_head.weight"], before["lm_head.weight"])
    moments = [k for k in step.state_dict() if k.startswith("optimizer.exp_avg.")]
    assert "optimizer.exp_avg.transformer.wte.weight" in moments
    assert not any(k.endswith("lm_head.weight") for k in moments)


def test_parameter_groups_lr_and_betas_match_torch():
    """Per-group lr, weight decay and betas (SGD and Adam) in one update op, vs torch.optim."""
    gen = np.random.default_rng(5)
    shapes = [(4, 3), (3,), (3, 1)]
    init = [gen.standard_normal(s).astype(np.float32) for s in shapes]

    class Three(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = (nn.Parameter(p) for p in init)

        def forward(self, x):
            return F.gelu(x @ self.a + self.b) @ self.c

    def spec(kind, a, b, c):
        extra = dict(betas=(0.8, 0.95)) if kind != "sgd" else {}
        return [{"params": [a], "weight_decay": 0.2, "lr": 0.05},
                {"params": [b, c], "weight_decay": 0.0, **extra}]

    makers = {"sgd": (lambda g: optim.SGD(g, lr=0.1, momentum=0.9),
                      lambda g: torch.optim.SGD(g, lr=0.1, momentum=0.9)),
              "adamw": (lambda g: optim.AdamW(g, lr=0.01, betas=(0.9, 0.99), max_grad_norm=0.5),
                        lambda g: torch.optim.AdamW(g, lr=0.01, betas=(0.9, 0.99))),
              "adam": (lambda g: optim.Adam(g, lr=0.01, weight_decay=0.3),
                       lambda g: torch.optim.Adam(g, lr=0.01, weight_decay=0.3))}
    for kind, (make, make_torch) in makers.items():
        model = Three()
        step = sg.compile_train_step(model, lambda out, y: F.mse_loss(out, y),
                                     make(spec(kind, model.a, model.b, model.c)),
                                     (np.zeros((5, 4), np.float32), np.zeros((5, 1), np.float32)))
        tp = [torch.nn.Parameter(torch.tensor(p)) for p in init]
        topt = make_torch(spec(kind, *tp))
        for i in range(4):
            x = gen.standard_normal((5, 4)).astype(np.float32)
            y = gen.standard_normal((5, 1)).astype(np.float32)
            step(x, y)
            topt.zero_grad()
            out = TF.gelu(torch.tensor(x) @ tp[0] + tp[1]) @ tp[2]
            TF.mse_loss(out, torch.tensor(y)).backward()
            if kind == "adamw":
                torch.nn.utils.clip_grad_norm_(tp, 0.5)
            topt.step()
        for name, p in zip("abc", tp):
            np.testing.assert_allclose(getattr(model, name).numpy(), p.detach().numpy(),
                                       rtol=2e-5, atol=2e-6, err_msg=f"{kind} {name}")


def test_parameter_group_errors():
    model = GPT()
    ps = [p for _, p in model.named_parameters()]
    with pytest.raises(ValueError, match="more than one parameter group"):
        optim.AdamW([{"params": ps}, {"params": ps[:1]}])
    with pytest.raises(ValueError, match="amsgrad must be the same in every parameter group"):
        optim.AdamW([{"params": ps[:1], "amsgrad": True}, {"params": ps[1:]}])
    with pytest.raises(TypeError, match="iterable"):
        optim.AdamW(0.01)
    x, y = batches()[0]
    opt = optim.AdamW([{"params": ps[1:]}])
    with pytest.raises(ValueError, match="in no parameter group"):
        build_train_graph(model, loss_fn, opt, signature_of(("x", "y"), (x, y)), seed=0)
    groups_ = optim.AdamW([{"params": ps[:2], "lr": 0.5}, {"params": ps[2:]}], lr=0.1,
                          betas=(0.8, 0.9)).param_groups
    assert groups_[0]["lr"] == 0.5 and groups_[1]["lr"] == 0.1
    assert groups_[1]["betas"] == (0.8, 0.9) and groups_[0]["weight_decay"] == 0.01
