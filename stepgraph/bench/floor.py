"""The step floor: what one training step of a workload cannot go below on the GPU at hand.

    floor = max(GEMM FLOPs the step needs / the GPU's measured GEMM peak at the precision,
                bytes the optimizer moves / the GPU's measured copy bandwidth)

The FLOPs are those the step needs (`needed_flops`), not the TFLOP/s column's convention
(workloads.flops_per_step): no input gradient for a first layer that reads the data (nothing
asks for it), and of causal attention's score and value products only the unmasked entries,
T(T+1)/2 of the T^2 per head. The peak is the best measured of the two GEMM libraries (cuBLAS
through torch.matmul, when PyTorch is installed, and cuBLASLt through stepgraph's own path) on
a few large square products (8192^3) at the precision; the bandwidth is a 1 GiB device-to-device
copy (read + write). The optimizer moves each parameter's value, gradient and state
(OPTIMIZER_BYTES), plus the bf16 weight copy it writes in bf16. The GEMMs and the update take the
maximum, not the sum: a layer's update can run as soon as its gradient exists, beside the
backward GEMMs still to come, and each is bound by a different resource (tensor cores, memory
bandwidth). Everything else a step does (activations, normalisation, the loss) is left out, so
every real step sits above the floor: `stepgraph bench --floor` reports how far each row does.
"""
from __future__ import annotations

from dataclasses import dataclass

from . import workloads as wl

# Bytes moved per float32 parameter by one update: reads of the value, the gradient and each
# state tensor, writes of the value and each state tensor.
OPTIMIZER_BYTES = {"adamw": 4 * (4 + 3),         # p, g, m, v read; p, m, v written
                   "sgd_momentum": 4 * (3 + 2),  # p, g, buf read; p, buf written
                   "sgd": 4 * (2 + 1)}           # p, g read; p written
BF16_COPY_BYTES = 2                              # the bf16 weight copy the update writes
PEAK_SIZE = 8192
COPY_BYTES = 1 << 30


@dataclass(frozen=True)
class StepFloor:
    workload: str
    precision: str
    gemm_flops: int           # needed_flops
    optimizer_bytes: int
    peak_tflops: float        # measured on the device: the best GEMM library's
    bandwidth_gbs: float      # measured on the device (GB/s, 1e9 bytes)
    peak_source: str = ""     # each library's measured TFLOP/s

    @property
    def gemm_us(self) -> float:
        return self.gemm_flops / (self.peak_tflops * 1e12) * 1e6

    @property
    def optimizer_us(self) -> float:
        return self.optimizer_bytes / (self.bandwidth_gbs * 1e9) * 1e6

    @property
    def floor_us(self) -> float:
        return max(self.gemm_us, self.optimizer_us)


def needed_flops(workload: wl.Workload) -> int:
    """GEMM FLOPs one training step cannot do without: per GEMM 2*N*K*M forward, as much for
    the weight gradient and as much for the input gradient, except the first layer's input
    gradient when that input is the data (every model but the GPT, whose first GEMM reads a
    LayerNorm's output); the GPT's attention over the T(T+1)/2 unmasked (query, key) pairs
    (QK^T and PV forward, each twice in the backward: 12 FLOPs per pair and channel)."""
    gemms = [s for s in wl.layer_shapes(workload) if s.kind in wl.GEMM_KINDS]
    model = workload.model
    data_first = not isinstance(model, wl.GPT)
    total = 0
    for index, s in enumerate(gemms):
        passes = 2 if index == 0 and data_first else 3
        total += passes * 2 * workload.batch * s.out_pixels * s.weight[0] * s.fan_in
    if isinstance(model, wl.GPT):
        pairs = model.block_size * (model.block_size + 1) // 2
        total += 12 * model.n_layer * workload.batch * pairs * model.n_embd
    return total


def optimizer_bytes(workload: wl.Workload, precision: str) -> int:
    """Bytes one optimizer update of `workload` reads and writes (float32 master values)."""
    spec = workload.optimizer
    kind = spec.kind if spec.kind != "sgd" or not spec.momentum else "sgd_momentum"
    per_parameter = OPTIMIZER_BYTES[kind] + (BF16_COPY_BYTES if precision == "bf16" else 0)
    return wl.parameter_count(workload) * per_parameter


def best_peak(peaks: dict[str, float]) -> tuple[float, str]:
    """(the best of the GEMM libraries' measured TFLOP/s, a line naming each one's)."""
    return max(peaks.values()), ", ".join(f"{name} {tflops:.1f}"
                                          for name, tflops in peaks.items())


def step_floor(workload: wl.Workload, name: str, precision: str, peak_tflops: float,
               bandwidth_gbs: float, peak_source: str = "") -> StepFloor:
    return StepFloor(name, precision, needed_flops(workload),
                     optimizer_bytes(workload, precision), peak_tflops, bandwidth_gbs,
                     peak_source)


# ---- measurements (CUDA) -----------------------------------------------------------------

def _best_ms(ctx, run, tries: int = 3) -> float:
    from stepgraph.backends.cuda.runtime.graph import time_on_device

    return min(time_on_device(ctx, run) for _ in range(tries))


def measure_peak_tflops(precision: str, n: int = PEAK_SIZE) -> float:
    """TFLOP/s of an (n, n) @ (n, n) product through stepgraph's cuBLASLt path."""
    import cupy as cp

    from stepgraph.backends import get_backend
    from stepgraph.backends.cuda.matmul import gemm

    ctx = get_backend("cuda").make_context(precision)
    with ctx.stream:      # made in the order of the timed work; random, as training data is
        rng = cp.random.default_rng(0)
        a, b = (rng.standard_normal((n, n), dtype=cp.float32) for _ in range(2))
        if precision == "bf16":            # bf16 bits: the float32 values' upper halves
            a, b = ((x.view(cp.uint32) >> 16).astype(cp.uint16) for x in (a, b))
        c = cp.empty_like(a)
    ms = _best_ms(ctx, lambda: gemm.matmul(ctx, a, b, c))
    return 2 * n ** 3 / (ms * 1e-3) / 1e12


def measure_torch_peak_tflops(precision: str, n: int = PEAK_SIZE, tries: int = 3) -> float:
    """TFLOP/s of an (n, n) @ (n, n) torch.matmul (cuBLAS) at the precision: strict float32
    at fp32 (TF32 off), TF32 at tf32, bfloat16 operands at bf16; timed with CUDA events over
    a few products after a warm-up one, the best of `tries`."""
    import torch

    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = precision == "tf32"
    try:
        dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        a, b = (torch.randn(n, n, device="cuda", dtype=dtype) for _ in range(2))
        c = torch.matmul(a, b)
        best_ms, reps = float("inf"), 5
        for _ in range(tries):
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                torch.matmul(a, b, out=c)
            stop.record()
            stop.synchronize()
            best_ms = min(best_ms, start.elapsed_time(stop) / reps)
        del a, b, c
        torch.cuda.empty_cache()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous
    return 2 * n ** 3 / (best_ms * 1e-3) / 1e12


def measure_peaks(precision: str) -> dict[str, float]:
    """Each GEMM library's measured TFLOP/s at the precision; cuBLAS only with PyTorch."""
    peaks = {"cuBLASLt (stepgraph)": measure_peak_tflops(precision)}
    try:
        import torch
    except ImportError:
        return peaks
    if torch.cuda.is_available():
        peaks["cuBLAS (torch.matmul)"] = measure_torch_peak_tflops(precision)
    return peaks


def measure_bandwidth_gbs(nbytes: int = COPY_BYTES) -> float:
    """GB/s of a device-to-device copy of nbytes, counting its read and its write."""
    import cupy as cp

    from stepgraph.backends import get_backend

    ctx = get_backend("cuda").make_context("fp32")
    with ctx.stream:
        src, dst = cp.zeros(nbytes, cp.uint8), cp.empty(nbytes, cp.uint8)

    def copy():
        cp.cuda.runtime.memcpyAsync(dst.data.ptr, src.data.ptr, nbytes,
                                    cp.cuda.runtime.memcpyDeviceToDevice, ctx.stream.ptr)

    ms = _best_ms(ctx, copy)
    return 2 * nbytes / (ms * 1e-3) / 1e9


def measure_floors(names: list[str], precisions: list[str], tiny: bool = False
                   ) -> list[StepFloor]:
    """The floor of each (workload, precision), each precision's peak measured once."""
    bandwidth = measure_bandwidth_gbs()
    floors = []
    for precision in precisions:
        peak, source = best_peak(measure_peaks(precision))
        floors += [step_floor(wl.get_workload(name, tiny), name, precision, peak, bandwidth,
                              source)
                   for name in names]
    return floors


def render_floors(floors: list[StepFloor], results) -> str:
    """The floors, and each measured row's step time as a multiple of its floor."""
    lines = ["step floor: max(needed GEMM FLOPs at the best measured GEMM peak, optimizer "
             "bytes at the measured copy bandwidth)",
             f"{'workload':<9}{'prec':<6}{'peak TFLOP/s':>13}{'GB/s':>8}{'GEMM µs':>10}"
             f"{'optim µs':>10}{'floor µs':>10}  rows (µs/step ÷ floor)"]
    for f in floors:
        rows = [f"{r.peer} {r.step_us / f.floor_us:.2f}x" for r in results
                if r.workload == f.workload and r.precision == f.precision
                and r.step_us is not None]
        lines.append(f"{f.workload:<9}{f.precision:<6}{f.peak_tflops:>13.1f}"
                     f"{f.bandwidth_gbs:>8.0f}{f.gemm_us:>10.1f}{f.optimizer_us:>10.1f}"
                     f"{f.floor_us:>10.1f}  {', '.join(rows)}")
    sources = {f.precision: f.peak_source for f in floors if f.peak_source}
    lines += [f"GEMM peak at {precision}, TFLOP/s: {source}"
              for precision, source in sources.items()]
    return "\n".join(lines)
