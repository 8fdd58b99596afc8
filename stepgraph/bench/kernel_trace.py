"""Where a training step spends its device time, kernel by kernel: records a few steps of any
step callable under torch.profiler (CUPTI reports the kernels of every CUDA graph replay in the
process, CuPy's included, so stepgraph's graph, torch's and inductor's are seen alike) and
summarises the device time per step by kernel family and the costliest kernels. The kernels are
timed inside the step as it really runs, not alone.

Used by scripts/kernel-trace (the bench's workloads and peers) and scripts/compat-bench --trace
(model files). Only `record` needs torch and a CUDA device; the families and the summary are
plain text arithmetic, tested on the CPU.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

_I = re.IGNORECASE

# (family, pattern on the kernel name without its parameter list), first match wins. The order
# is what makes the patterns short: fused attention kernels name GEMM and conv-like parts
# (fmha_cutlass..., flash_bwd_convert_dq), cuDNN launches norms and layout transposes besides
# convolutions, and cuBLAS's split-k kernel says "reduce". Names come from stepgraph's .cu files,
# cuDNN / cuBLAS(Lt) / CUTLASS, and ATen (at::native::...); inductor's are below.
RULES: tuple[tuple[str, re.Pattern], ...] = (
    # cuDNN's sdpa backward also runs two cudnn::fusion kernels: dot(dO, O) and the dQ GEMM
    ("attention", re.compile(r"flash|fmha|sdpa|attention|attn|dot_do_o|matmul_dq", _I)),
    # the step's bookkeeping counts as the optimizer's: lr schedule, step counter, loss scale,
    # gradient clipping's global norm, torch's multi-tensor (foreach / fused) launches
    ("optimizer", re.compile(r"sgd|adam|adagrad|rmsprop|lamb_|optimizer|foreach|multi_tensor_"
                             r"|lr_schedule|step_increment|advance_step|loss_scale|global_norm"
                             r"|lpnorm|amp_update_scale|non_finite", _I)),
    ("conv wgrad", re.compile(r"wgrad|backward_filter|bwd_filter|conv\w*grad_weight", _I)),
    ("conv dgrad", re.compile(r"dgrad|backward_data|bwd_data|conv\w*grad_input"
                              r"|conv\w*_backward_kernel|col2im", _I)),
    ("norm", re.compile(r"batch_?norm|layer_?norm|rms_?norm|group_?norm|instance_?norm"
                        r"|(?<![a-z])bn_(?:fw|bw)|welford|GammaBeta|RowwiseMoments"
                        r"|Compute\w*(?:Gradients|Params)|running_stats", _I)),
    # cuDNN's layout transposes, before the rule that takes the rest of its kernels as convs
    ("copy / layout", re.compile(r"nchwToNhwc|nhwcToNchw|nchw2nhwc|nhwc2nchw", _I)),
    ("pointwise", re.compile(r"bias_act", _I)),    # conv2d_bias_act: the epilogue, not the conv
    ("conv fprop", re.compile(r"fprop|conv(?:olution|olve|_depthwise|[123]d|_)|im2col"
                              r"|winograd|cudnn", _I)),
    ("gemm", re.compile(r"gemm|gemv|cublas|cutlass|nvjet|matmul|splitKreduce|dot_kernel", _I)),
    # after the convs and GEMMs, whose names say "indexed" (cuDNN) or carry CUTLASS's copy atoms
    ("copy / layout", re.compile(r"copy|transpose|permute|(?<![a-z])cat(?![a-z])|CatArray"
                                 r"|concat|slice_|gather(?!TopK)|scatter|(?<![a-z])index(?!ed)"
                                 r"|embedding|(?<![a-z])cast_|pad_nd|reflection_pad"
                                 r"|replication_pad", _I)),
    ("softmax", re.compile(r"softmax", _I)),
    ("loss", re.compile(r"cross_entropy|nll_loss|mse_|_loss|smooth_l1|binary_cross", _I)),
    ("pool / resize", re.compile(r"pool|upsample|interp|resize|bilinear|bicubic|nearest"
                                 r"|grid_sampl", _I)),
    ("reduction", re.compile(r"reduce|reduction|cumsum|cumprod|scan|topk|top1|argmax|argmin"
                             r"|(?<![a-z])sum(?![a-z])|mean|moments", _I)),
    ("pointwise", re.compile(r"elementwise|pointwise|binary|unary|scalar_|act_forward"
                             r"|act_backward|add_forward|fill|dropout|bias|relu|gelu|silu"
                             r"|sigmoid|tanh|triangle|tril|triu|arange|random|where|Functor"
                             r"|distribution|philox|clamp|masked", _I)),
)
FAMILIES = tuple(dict.fromkeys(label for label, _ in RULES)) + ("other",)

# Inductor's generated kernels: triton_{poi,red,per,tem}_fused_<the aten ops fused>_<n>. A
# pointwise or reduction kernel names the ops it absorbed (triton_poi_fused_convolution_relu:
# the conv's bias and ReLU, not the conv), so only the families that such a kernel can be are
# looked for, and its kind decides the rest; a template kernel is a GEMM, conv or attention.
TRITON = re.compile(r"^triton_(poi|red|per|tem)_")
TRITON_FUSED_FAMILIES = ("attention", "optimizer", "norm", "softmax", "loss", "pool / resize")
TRITON_COPY_ONLY = re.compile(r"^triton_poi_fused(?:_+(?:to_copy|clone|cat|stack|permute"
                              r"|transpose|view|expand|slice|select|copy|constant_pad_nd"
                              r"|index|embedding))+_\d+$")


def without_arguments(name: str) -> str:
    """'void f<int>(float*, int)' -> 'void f<int>': CUPTI's demangled names end in the
    parameter types, which name types (IndexType, ...), not the op."""
    if not name.endswith(")"):
        return name
    depth = 0
    for i in range(len(name) - 1, -1, -1):
        depth += {")": 1, "(": -1}.get(name[i], 0)
        if depth == 0:
            return name[:i]
    return name


def family(name: str) -> str:
    """The kernel family of one kernel name (FAMILIES; "other" when no rule matches)."""
    name = without_arguments(name)
    triton = TRITON.match(name)
    if triton:
        kind = triton.group(1)
        if kind == "tem":
            return "attention" if re.search(r"attention|attn", name, _I) else \
                "conv fprop" if "convolution" in name else "gemm"
        if TRITON_COPY_ONLY.match(name):
            return "copy / layout"
        for label, pattern in RULES:
            if label in TRITON_FUSED_FAMILIES and pattern.search(name):
                return label
        return "pointwise" if kind == "poi" else "reduction"
    for label, pattern in RULES:
        if pattern.search(name):
            return label
    return "other"


@dataclass(frozen=True)
class KernelTime:
    """One kernel name over the recorded steps."""
    name: str
    family: str
    us_per_step: float
    calls_per_step: float


@dataclass(frozen=True)
class StepTrace:
    """The device time of one step: total, by family (costliest first) and by kernel
    (costliest first, every kernel seen)."""
    steps: int
    total_us: float
    launches_per_step: float
    families: dict[str, float]
    kernels: tuple[KernelTime, ...]

    def as_json(self, top: int | None = None) -> dict:
        """The JSON form (the first `top` kernels; all with None), kernels by name in cost
        order, as scripts/kernel-trace has always written them."""
        return {"steps": self.steps, "total_us": self.total_us,
                "launches_per_step": self.launches_per_step, "families": dict(self.families),
                "kernels": {k.name: {"us_per_step": k.us_per_step, "calls": k.calls_per_step,
                                     "family": k.family}
                            for k in self.kernels[:top]}}


def summarize(events: Iterable[tuple[str, float]], steps: int) -> StepTrace:
    """The per-step figures of (kernel name, device µs) events recorded over `steps` steps."""
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    totals: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    for name, us in events:
        totals[name] += us
        counts[name] += 1
    kernels = sorted((KernelTime(name, family(name), us / steps, counts[name] / steps)
                      for name, us in totals.items()),
                     key=lambda k: (-k.us_per_step, k.name))
    families: dict[str, float] = defaultdict(float)
    for k in kernels:
        families[k.family] += k.us_per_step
    return StepTrace(steps, sum(k.us_per_step for k in kernels),
                     sum(counts.values()) / steps,
                     dict(sorted(families.items(), key=lambda kv: (-kv[1], kv[0]))),
                     tuple(kernels))


def record(run_step: Callable[[int], Any], synchronize: Callable[[], None], steps: int,
           n_batches: int) -> list[tuple[str, float]]:
    """(kernel name, device µs) of every kernel `steps` calls of run_step(i % n_batches) launch,
    the step already warm. Memcpy / Memset records are left out: the steps' data is on the
    device, so those are the profiler's and the feed's, not the step's arithmetic."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(steps):
            run_step(i % n_batches)
        synchronize()
    return [(e.name, e.device_time_total) for e in prof.events()
            if e.device_type == DeviceType.CUDA and not e.name.startswith(("Memcpy", "Memset"))]


def report(title: str, trace: StepTrace, top: int) -> str:
    """One system's step: total and launches, µs by family, then the `top` costliest kernels."""
    lines = [f"== {title}: {trace.total_us:,.1f} µs of kernels a step, "
             f"{trace.launches_per_step:.0f} launches a step"]
    lines += [f"   {label:<14}{us:>10,.1f} µs" for label, us in trace.families.items()]
    lines.append(f"   {'µs/step':>9} {'calls':>5}  kernel")
    lines += [f"   {k.us_per_step:>9,.1f} {k.calls_per_step:>5.0f}  {k.name[:150]}"
              for k in trace.kernels[:top]]
    return "\n".join(lines)


def comparison(traces: Mapping[str, Mapping | None]) -> str:
    """Families as rows, systems as columns (µs a step), from StepTrace.as_json() forms; a
    system without one reads "-", one whose recording failed ({"error": ...}) "failed".
    Families by their largest cost over the systems; the total and launches last."""
    systems = list(traces)
    usable = {s: t for s, t in traces.items() if t and "error" not in t}
    costliest: dict[str, float] = defaultdict(float)
    for t in usable.values():
        for label, us in t["families"].items():
            costliest[label] = max(costliest[label], us)
    labels = sorted(costliest, key=lambda label: (-costliest[label], label))

    def cell(system: str, value: Callable[[Mapping], float], fmt: str) -> str:
        t = traces[system]
        if not t:
            return "-"
        return "failed" if "error" in t else format(value(t), fmt)

    lines = [("µs a step", *systems)]
    lines += [(label, *(cell(s, lambda t, lb=label: t["families"].get(lb, 0.0), ",.1f")
                        for s in systems)) for label in labels]
    lines.append(("total", *(cell(s, lambda t: t["total_us"], ",.1f") for s in systems)))
    lines.append(("launches", *(cell(s, lambda t: t["launches_per_step"], ".0f")
                                for s in systems)))
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    return "\n".join("  ".join([line[0].ljust(widths[0])] +
                               [c.rjust(w) for c, w in zip(line[1:], widths[1:])])
                     for line in lines)
