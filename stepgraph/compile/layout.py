"""Channels-last execution: a forward graph's image tensors stored NHWC between convolutions.

cuDNN's tensor-core convolutions (tf32, bf16) run 1.4-5.9x faster on channels-last
(NHWC) tensors than on NCHW ones (docs/perf-notes.md, conv layout). `to_channels_last`
rewrites a traced forward graph, before autodiff, so that the backward is the NHWC ops' own
VJPs:

- the image ops run with attrs layout "NHWC" (ops/layout.py LAYOUTS): conv2d, batch_norm_train,
  maxpool2d, avgpool2d (adaptive_avg_pool2d is an avgpool2d), whose inputs and outputs are
  stored (N, H, W, C);
- a conv weight enters as a permute of its (O, C/groups, kh, kw) parameter to
  (O, kh, kw, C/groups) (cuDNN's KRSC filter): the parameter, its optimizer state and the
  state_dict keep PyTorch's layout; the weight's gradient comes back through the permute's
  VJP, an exact copy;
- elementwise ops (act, scalar, add, binary) run on the NHWC values as they are; a broadcast
  operand of a binary is re-laid to match (a channel vector (C, 1, 1) becomes a (1, 1, 1, C)
  view); reduce_sum runs over the matching axes when its result is the same either way
  (x.mean((2, 3)));
- concat of 4-D values runs on their twins, along the matching axis (torch.cat(.., dim=1) of
  feature maps: the last axis);
- every other op reads NCHW: a value is converted back once, where first needed. A value
  whose H and W are 1 (global pooling's output) is the same bytes in both layouts: it is
  converted by a reshape (a view), not a copy.

- a user's permute of a 4-D value is a layout change the pass sees through: x.permute(0, 2, 3,
  1) of a value with an NHWC twin IS that twin (a reshape: a view), and x.permute(0, 3, 1, 2)
  makes an NCHW value whose twin is x (nothing is emitted; an NCHW reader gets it by the
  conversion back, the copy the user's permute was). Other permutes are emitted where first
  read, composed with the permutes or the twin they read (a chain of transposes, movedim: the
  tracer emits each as a permute), so each chain costs at most one copy.

So the ResNet's step converts its input once (NCHW -> NHWC) and nothing else: the pooled
features reach flatten and the classifier through a view. A ConvNeXt block (depthwise conv,
permute to NHWC, LayerNorm and Linears on the last axis, permute back, residual add) runs
with no conversion at all.

Values stay what their shapes say (row-major, contiguous): a value's NHWC "twin" is a new Value
of shape (N, H, W, C); the NCHW original keeps its object, and is produced again (by the
conversion back) only where an NCHW reader needs it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..ir.graph import Graph, Node, Value
from ..ir.ops import OPS, infer_outputs
from ..ops.layout import TO_NCHW, TO_NHWC, layout_of, nchw_shape

MEMORY_FORMATS = ("auto", "channels_last", "contiguous")
# Precisions at which the CUDA backend's convolutions run on tensor cores, where cuDNN's NHWC
# plans pay (fp32 is NCHW's: its NHWC plans are as fast or far slower).
TENSOR_CORE_PRECISIONS = ("tf32", "bf16")
IMAGE_OPS = ("conv2d", "batch_norm_train", "maxpool2d", "avgpool2d")
ELEMENTWISE_OPS = ("act", "scalar", "add")
LABEL = "layout"          # the label of the conversions the pass adds (profiles group by it)


@dataclass
class LayoutReport:
    """What `to_channels_last` did: the conversions it added, and the nodes it moved to
    NHWC."""

    to_nhwc: int = 0          # activation copies NCHW -> NHWC (permute)
    to_nchw: int = 0          # activation copies NHWC -> NCHW (permute)
    weights: int = 0          # conv weights permuted to (O, kh, kw, C/groups) (1x1: views)
    views: int = 0            # conversions that are reshapes (size-1 axes only): no copy
    absorbed: int = 0         # user permutes between NCHW and NHWC that became a twin or a
                              # view of one (no copy)
    nhwc_nodes: int = 0       # forward nodes that run channels-last

    @property
    def copies(self) -> int:
        """Activation conversions that move data (the forward's; autodiff adds one per
        conversion whose input needs a gradient)."""
        return self.to_nhwc + self.to_nchw


def resolve_memory_format(memory_format: str, device: str, precision: str) -> str:
    """"channels_last", "contiguous" or "auto" for a step's options. "auto" stays "auto"
    (decided per traced model by `channels_last_pays`) on CUDA at a tensor-core precision when
    cuDNN can run the convolutions, else it is "contiguous". An explicit choice is kept:
    channels-last convolutions that cuDNN cannot run (or all, without it) run NCHW between
    permutes (backends/cuda/conv/conv.py), correct but slow."""
    if memory_format not in MEMORY_FORMATS:
        raise ValueError(f"memory_format must be one of {MEMORY_FORMATS}, got {memory_format!r}")
    if memory_format != "auto":
        return memory_format
    if device != "cuda" or precision not in TENSOR_CORE_PRECISIONS:
        return "contiguous"
    from ..backends.cuda.conv import conv_cudnn

    return "auto" if conv_cudnn.available() else "contiguous"


TENSOR_CORE_CHANNELS = 8      # channel multiple of cuDNN's NHWC tensor-core kernels
# Channels-last pays when the convolutions cuDNN runs on its NHWC fast kernels carry at least
# this share of the convolution FLOPs. Those run 1.4-5.9x faster NHWC; the others run NHWC too
# (cuDNN converts inside the call, or _through_nchw), at worst about as slow as NCHW plus a
# transform of their input and output. At half the FLOPs the paying half's gain (>= 1.4x on
# it) covers the rest's transforms, which are memory-bound and cost about one pass over
# tensors the paying convs also read and write; below half the balance tips to the
# conversions (the MNIST cnn, where no conv pays, ran 161 µs channels-last against 109 µs
# NCHW in tf32 on an H100).
PAYING_SHARE = 0.5


def channels_last_pays(graph: Graph) -> bool:
    """Whether channels-last is worth its conversions for this forward: the convs with
    tensor-core channel counts (_conv_pays) carry at least PAYING_SHARE of the FLOPs of the
    convs that vote. So one odd conv (a U-Net's 32 -> 2 output conv, SqueezeNet's 512 -> 10
    classifier) no longer sends a whole net to NCHW, while the MNIST cnn (1 -> 10 -> 20: no conv
    pays) stays NCHW."""
    return paying_share(graph) >= PAYING_SHARE


# The paying share from which the rule is not second-guessed by timing both layouts
# (compile/layout_choice.py): timed both ways on an H200 (docs/perf-notes.md, "2026-11-30,
# 22:30-23:20 UTC"), every compatibility conv net (share 0.999-1.0) ran channels-last 1.3-1.7x
# faster at bf16 and 1.1-1.3x at tf32, and mixer (1.0, where its convolutions are a small part
# of the step) 1.04x; building the other layout as well cost a first compile up to 13 s more
# (mobilenet: its depthwise convolutions' cuDNN plans), over the 10 s a first step may take.
# Below it the rule can lose: convolutions of 32 and 36 channels (share 0.29, the rule's
# answer contiguous) ran channels-last 1.3x faster.
SURE_SHARE = 0.9


def rule_is_sure(graph: Graph) -> bool:
    """Whether the rule's answer stands without timing: the tensor-core convolutions carry at
    least SURE_SHARE of the voting FLOPs. A net with mixed channel counts, or none that vote,
    is timed both ways."""
    return paying_share(graph) >= SURE_SHARE


def paying_share(graph: Graph) -> float:
    """The share of the voting convs' FLOPs that cuDNN's NHWC tensor-core kernels run (0 when
    no conv votes). Of a forward's convs, in either layout: in a whole step's graph, the
    backward's are left out."""
    total = paying = 0
    for n in graph.nodes:
        if n.op != "conv2d" or len(n.inputs[0].shape) != 4 or n.label.endswith(" bwd"):
            continue
        pays = _conv_pays(n)
        if pays is None:
            continue
        flops = math.prod(n.outputs[0].shape) * math.prod(n.inputs[1].shape[1:])
        total += flops
        paying += flops if pays else 0
    return paying / total if total else 0.0


def _conv_pays(n: Node) -> bool | None:
    """Whether a conv2d node has channel counts cuDNN's NHWC fast kernels take; None for
    a conv reading fewer than TENSOR_CORE_CHANNELS channels (an RGB stem, an MNIST net's first
    conv), which does not vote: its input is converted once whatever the layout, and it is a
    small share of a net that pays. Dense and grouped convs need their per-group input and
    output channels in multiples of TENSOR_CORE_CHANNELS (each group is a GEMM of that
    depth); a depthwise conv (one input channel per group) needs its channel counts in
    multiples of it (cuDNN's NHWC depthwise kernels, which PyTorch's channels_last gets)."""
    c = nchw_shape(n.inputs[0].shape, layout_of("conv2d", n.attrs))[1]
    o, groups = n.inputs[1].shape[0], n.attrs.get("groups", 1)
    if c < TENSOR_CORE_CHANNELS:
        return None
    if c == groups:                         # depthwise (o = c * multiplier)
        c_unit, o_unit = c, o
    else:
        c_unit, o_unit = c // groups, o // groups
    return c_unit % TENSOR_CORE_CHANNELS == 0 and o_unit % TENSOR_CORE_CHANNELS == 0


def apply_memory_format(graph: Graph, memory_format: str) -> Graph:
    """The traced forward in the resolved memory format (resolve_memory_format)."""
    if memory_format == "channels_last" or (memory_format == "auto"
                                            and channels_last_pays(graph)):
        return to_channels_last(graph)[0]
    return graph


def to_channels_last(graph: Graph) -> tuple[Graph, LayoutReport]:
    """The forward `graph` with its image ops channels-last (module docstring), and what was
    done. A graph without conv2d is returned as it is."""
    if not any(n.op == "conv2d" for n in graph.nodes):
        return graph, LayoutReport()
    rewrite = _Rewrite(graph)
    for node in graph.nodes:
        rewrite.visit(node)
    outputs = {k: rewrite.nchw(v) for k, v in graph.outputs.items()}
    return Graph(rewrite.nodes, graph.inputs, graph.params, graph.state, outputs), rewrite.report


def _is_view(shape: tuple[int, ...], dims: tuple[int, ...]) -> bool:
    """Whether permuting `shape` by `dims` keeps the elements in place (only size-1 axes
    move), so a reshape does it."""
    moved = [d for d in dims if shape[d] != 1]
    return moved == sorted(moved)


# Where each NCHW axis sits in an NHWC array.
_NHWC_AXIS = {a: TO_NHWC.index(a) for a in range(4)}


class _Rewrite:
    """The node-by-node rewrite: `twin` maps an NCHW value to its NHWC twin; `ready` holds the
    values the new node list has produced so far (and the externals)."""

    def __init__(self, graph: Graph):
        self.nodes: list[Node] = []
        self.twin: dict[Value, Value] = {}
        self.relaid: dict[Value, Value] = {}     # broadcast operands of rank < 4, re-laid
        self.krsc: dict[Value, Value] = {}       # conv weights as (O, kh, kw, C/groups)
        # user permutes not emitted yet: value -> (a ready value, dims of it, the node's label)
        self.pending: dict[Value, tuple[Value, tuple[int, ...], str]] = {}
        self.ready: set[Value] = set(graph.externals)
        self.report = LayoutReport()

    # ---- emitting ----------------------------------------------------------------------------
    def emit(self, op: str, inputs: list[Value], attrs: dict, label: str,
             outputs: list[Value] | None = None) -> list[Value]:
        """Append a node; its outputs are new Values, or `outputs` (whose shapes must match)."""
        specs = infer_outputs(op, inputs, attrs)
        if outputs is None:
            outputs = [Value(shape, dtype) for shape, dtype in specs]
        assert [(v.shape, v.dtype) for v in outputs] == [(tuple(s), d) for s, d in specs], \
            (op, outputs, specs)
        self.nodes.append(Node(op, list(inputs), outputs, attrs, OPS[op].mutates(attrs), label))
        self.ready.update(outputs)
        return outputs

    def convert(self, v: Value, dims: tuple[int, ...], out: Value | None = None,
                what: str = "") -> Value:
        """v permuted by dims: a reshape when only size-1 axes move, else a permute copy."""
        shape = tuple(v.shape[d] for d in dims)
        if _is_view(v.shape, dims):
            self.report.views += 1
            return self.emit("reshape", [v], {"shape": shape}, LABEL, out and [out])[0]
        if what:
            setattr(self.report, what, getattr(self.report, what) + 1)
        return self.emit("permute", [v], {"dims": dims}, LABEL, out and [out])[0]

    # ---- the two layouts of a value ----------------------------------------------------------
    def nhwc(self, v: Value) -> Value:
        """v's NHWC twin, made from v (once) when v has none; a pending permute's from what
        it permutes (one copy for both permutes)."""
        if v not in self.twin:
            if v in self.pending and v not in self.ready:
                base, dims, _ = self.pending[v]
                self.twin[v] = self.convert(base, tuple(dims[d] for d in TO_NHWC),
                                            what="to_nhwc")
            else:
                self.twin[v] = self.convert(self.nchw(v), TO_NHWC, what="to_nhwc")
        return self.twin[v]

    def nchw(self, v: Value) -> Value:
        """v itself, produced (once) from its twin when its producer now runs NHWC, or by its
        pending permute."""
        if v not in self.ready:
            if v in self.pending:
                base, dims, label = self.pending[v]
                op, attrs = ("reshape", {"shape": v.shape}) if _is_view(base.shape, dims) \
                    else ("permute", {"dims": dims})
                self.emit(op, [base], attrs, label, [v])
            else:
                self.convert(self.twin[v], TO_NCHW, out=v, what="to_nchw")
        return v

    def as_permuted(self, v: Value) -> tuple[Value, tuple[int, ...]]:
        """(u, dims) with u ready and v == u.permute(dims), u v's NHWC twin where it has one,
        what v's pending permute reads where it is one, else v itself."""
        if v in self.twin:
            return self.twin[v], TO_NCHW
        if v in self.pending:
            return self.pending[v][:2]
        return self.nchw(v), tuple(range(len(v.shape)))

    def relay(self, v: Value, rank: int) -> Value:
        """A broadcast operand of an NHWC binary: 4-D ones as twins; lower ranks (aligned
        with the trailing NCHW axes) re-laid to the NHWC positions of those axes."""
        if len(v.shape) == 4:
            return self.nhwc(v)
        if not v.shape:
            return self.nchw(v)
        if v in self.relaid:
            return self.relaid[v]
        padded = (1,) * (rank - len(v.shape)) + tuple(v.shape)
        stored = tuple(padded[d] for d in TO_NHWC)
        u = self.nchw(v)
        if _is_view(padded, TO_NHWC):
            self.report.views += 1
            out = self.emit("reshape", [u], {"shape": stored}, LABEL)[0]
        else:
            if padded != tuple(v.shape):
                u = self.emit("reshape", [u], {"shape": padded}, LABEL)[0]
            out = self.convert(u, TO_NHWC, what="to_nhwc")
        self.relaid[v] = out
        return out

    # ---- the rewrite -------------------------------------------------------------------------
    def visit(self, n: Node) -> None:
        x = n.inputs[0] if n.inputs else None
        four_d = x is not None and len(x.shape) == 4
        if n.op == "conv2d" and four_d and n.attrs.get("layout", "NCHW") == "NCHW":
            self.conv2d(n)
        elif n.op == "conv2d_grad_input" and four_d and \
                n.attrs.get("layout", "NCHW") == "NCHW":
            self.conv_transpose(n)
        elif n.op in IMAGE_OPS[1:] and four_d and x in self.twin \
                and n.attrs.get("layout", "NCHW") == "NCHW":
            self.channels_last(n, [self.nhwc(x)] + [self.nchw(v) for v in n.inputs[1:]])
        elif n.op in ELEMENTWISE_OPS and four_d and any(v in self.twin for v in n.inputs):
            self.channels_last(n, [self.nhwc(v) for v in n.inputs], layout=False)
        elif n.op == "binary" and len(n.outputs[0].shape) == 4 and \
                any(v in self.twin for v in n.inputs):
            self.channels_last(n, [self.relay(v, 4) for v in n.inputs], layout=False)
        elif n.op == "permute" and four_d:
            self.permute(n)
        elif n.op == "concat" and four_d and any(v in self.twin for v in n.inputs):
            # torch.cat of feature maps (a U-Net's skip connections): along the same axis
            # of the twins
            self.channels_last(n, [self.nhwc(v) for v in n.inputs], layout=False,
                               attrs=dict(n.attrs, dim=_NHWC_AXIS[n.attrs["dim"] % 4]))
        elif n.op == "reduce_sum" and four_d and x in self.twin and _keeps_order(n.attrs["axes"]):
            axes = tuple(sorted(_NHWC_AXIS[a % 4] for a in n.attrs["axes"]))
            self.emit("reduce_sum", [self.twin[x]], dict(n.attrs, axes=axes), n.label,
                      n.outputs)
            self.report.nhwc_nodes += 1
        else:
            self.emit(n.op, [self.nchw(v) for v in n.inputs], n.attrs, n.label, n.outputs)

    def permute(self, n: Node) -> None:
        """A user's permute of a 4-D value (module docstring): composed with what its input
        is a permute of, it is a view of a ready value, an NCHW value whose twin is a ready
        value, or a permute emitted when first read."""
        base, dims = self.as_permuted(n.inputs[0])
        dims = tuple(dims[d] for d in n.attrs["dims"])
        y = n.outputs[0]
        if tuple(dims[d] for d in TO_NHWC) == tuple(range(4)):     # y.permute(TO_NHWC) is base
            self.twin[y] = base
            self.report.absorbed += 1
            return
        if dims == tuple(range(4)):
            self.report.absorbed += 1
        self.pending[y] = (base, dims, n.label)

    def conv2d(self, n: Node) -> None:
        bias = [self.nchw(v) for v in n.inputs[2:]]
        self.channels_last(n, [self.nhwc(n.inputs[0]), self.weight_krsc(n.inputs[1])] + bias)

    def conv_transpose(self, n: Node) -> None:
        """conv_transpose2d's node (conv2d's data gradient): NHWC as the backward of an NHWC
        conv2d runs it, its input_shape given channels-last too."""
        shape = tuple(n.attrs["input_shape"][d] for d in TO_NHWC)
        self.channels_last(n, [self.nhwc(n.inputs[0]), self.weight_krsc(n.inputs[1])],
                           attrs=dict(n.attrs, layout="NHWC", input_shape=shape))

    def weight_krsc(self, w: Value) -> Value:
        """A conv weight (O, C/groups, kh, kw) as cuDNN's KRSC filter, permuted once however
        many convs share it."""
        if w not in self.krsc:
            self.krsc[w] = self.convert(self.nchw(w), TO_NHWC, what="weights")
        return self.krsc[w]

    def channels_last(self, n: Node, inputs: list[Value], layout: bool = True,
                      attrs: dict | None = None) -> None:
        """n run on NHWC `inputs`: with attrs layout "NHWC" (image ops), as it is
        (elementwise) or with `attrs`; each 4-D output gets its twin, the others keep their
        Values."""
        if attrs is None:
            attrs = dict(n.attrs, layout="NHWC") if layout else dict(n.attrs)
        specs = infer_outputs(n.op, inputs, attrs)
        outs = []
        for v, (shape, dtype) in zip(n.outputs, specs):
            if len(v.shape) == 4:
                assert shape == tuple(v.shape[d] for d in TO_NHWC), (n, v, shape)
                self.twin[v] = Value(shape, dtype)
                outs.append(self.twin[v])
            else:
                outs.append(v)
        self.emit(n.op, inputs, attrs, n.label, outs)
        self.report.nhwc_nodes += 1


def _keeps_order(axes) -> bool:
    """Whether a reduce_sum over these NCHW axes of a 4-D value leaves its other axes in the
    same order in NHWC (then its result is the same array in both layouts)."""
    kept = [_NHWC_AXIS[a] for a in range(4) if a not in {b % 4 for b in axes}]
    return kept == sorted(kept)
