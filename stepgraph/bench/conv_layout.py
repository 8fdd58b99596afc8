"""`python -m stepgraph.bench.conv_layout [--batch 512] [--out DIR]`: the cuDNN conv plans
(backends/cuda/conv/conv_cudnn.py) on ResNet-shaped 3x3 convolutions, NCHW against NHWC, fp32 and
tf32, next to the own kernels (NCHW): does choosing the memory layout per model pay?

Every time is device time of one op as a captured graph replay (graph.time_on_device), the
fastest plan of each (op, layout, precision); --accuracy adds each NCHW plan's error against
the own exact-fp32 GEMM path. A first section lists, per problem kind, the
ranked engine configurations and which of them the filters keep (a survey of what cuDNN
offers here; heuristic mode B's extra candidates are the "cudnn:B<i>" paths), and the weight
gradients' nondeterministic plans (compile_train_step(deterministic=False)) are timed beside
the deterministic ones. Results go to stdout and, with --out, to conv_layout.json.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

RESNET = ((64, 32), (128, 16), (256, 8))      # (channels, pixels) of the 3x3 stage convs
OPS = ("conv2d", "conv2d_grad_input", "conv2d_grad_weight")


def survey(ctx, conv_cudnn, g, op: str, precision: str, **kw) -> dict:
    """Every ranked configuration of one problem: name, and whether it builds under the
    module's filters (with its workspace) or why not."""
    cudnn = conv_cudnn._load()[0]
    p = conv_cudnn.Problem(op, g, "float32", precision, **kw)
    start = time.perf_counter()
    plans = conv_cudnn._build(cudnn, p, conv_cudnn.handle(ctx))
    return {"problem": f"{op} {precision} {kw}", "build_s": round(time.perf_counter() - start, 3),
            "entries": plans.entries, "reason": plans.reason}


def as_layout(cp, a, layout: str):
    """a's (N, C, H, W) values in an array of that shape whose memory is `layout`."""
    if layout == "NCHW":
        return a
    return cp.ascontiguousarray(a.transpose(0, 2, 3, 1)).transpose(0, 3, 1, 2)


def time_paths(ctx, paths: dict, repeats: int = 3) -> dict[str, float]:
    from stepgraph.backends.cuda.runtime.graph import time_on_device

    out = {}
    for name, run in paths.items():
        try:
            out[name] = round(time_on_device(ctx, run, repeats) * 1e3, 1)     # µs
        except Exception as err:  # report, keep measuring the others
            out[name] = f"{type(err).__name__}: {str(err)[:120]}"
    return out


def accuracy(ctx, paths: dict, out, ref) -> dict[str, str]:
    """Relative error (Frobenius norms, float64) of each path's output `out` against `ref`."""
    import cupy as cp

    errs = {}
    with ctx.stream:
        want = ref.astype(cp.float64)
        norm = float(cp.linalg.norm(want))
        for name, run in paths.items():
            out.fill(cp.nan)
            run()
            errs[name] = f"{float(cp.linalg.norm(out.astype(cp.float64) - want)) / norm:.1e}"
    return errs


def own_paths(conv, ctx, node, ins, outs) -> dict:
    offered = {}
    real = conv._run_faster
    conv._run_faster = lambda node, ctx, g, dtype, paths: offered.update(paths)
    try:
        conv.IMPLS[node.op](node, ins, outs, ctx)
    finally:
        conv._run_faster = real
    return {k: v for k, v in offered.items() if not k.startswith("cudnn")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--out", default="")
    ap.add_argument("--budget", type=float, default=90.0, help="seconds; stops measuring after")
    ap.add_argument("--accuracy", action="store_true",
                    help="also each NCHW cuDNN plan's error against the exact-fp32 GEMM path")
    args = ap.parse_args(argv)

    import cupy as cp

    from stepgraph.backends.cuda.conv import conv, conv_cudnn
    from stepgraph.backends.cuda.backend import CudaBackend
    from stepgraph.ir.graph import Node, Value

    if not conv_cudnn.available():
        print("cuDNN unavailable:", conv_cudnn.unavailable_reason())
        return 2
    cudnn = conv_cudnn._load()[0]
    backend = CudaBackend()
    props = cp.cuda.runtime.getDeviceProperties(0)
    report = {"device": props["name"].decode(), "cudnn": cudnn.backend_version_string(),
              "frontend": cudnn.__version__, "survey": [], "times": []}
    print(f"device {report['device']}  cuDNN {report['cudnn']}  frontend {report['frontend']}",
          flush=True)
    t0 = time.perf_counter()

    # ---- survey: which configurations cuDNN ranks and which the filters keep ------------
    ctx = backend.make_context("fp32")
    small = conv.Geometry(8, 32, 16, 16, 32, 3, 3, 1, 1, 1, 1)
    grouped = conv.Geometry(8, 32, 16, 16, 32, 3, 3, 1, 1, 2, 2, 2, 2, 4)
    for g in (small, grouped):
        for precision in ("fp32", "tf32"):
            for op in OPS:
                report["survey"].append(survey(ctx, conv_cudnn, g, op, precision))
            report["survey"].append(survey(ctx, conv_cudnn, g, "conv2d", precision,
                                           bias=True, relu=True))
    conv_cudnn.RUNTIME_COMPILED = True
    for precision in ("fp32", "tf32"):
        entry = survey(ctx, conv_cudnn, small, "conv2d", precision, bias=True, relu=True)
        entry["problem"] += " RUNTIME_COMPILED=True"
        report["survey"].append(entry)
    conv_cudnn.RUNTIME_COMPILED = False
    for precision in ("fp32", "tf32"):
        for layout in conv_cudnn.LAYOUTS:
            report["survey"].append(survey(ctx, conv_cudnn, small, "conv2d_grad_weight",
                                           precision, layout=layout, deterministic=False))
    for s in report["survey"]:
        names = ", ".join(f"[{c.path}] {c.name} ws={c.workspace}" for c in s["entries"])
        print(f"{s['problem']}: {len(s['entries'])} built in {s['build_s']} s: {names}"
              + (f"  reason: {s['reason']}" if s["reason"] else ""), flush=True)
    conv_cudnn._PLANS.clear()

    # ---- timings: NCHW vs NHWC cuDNN plans, and the own kernels ----------------------------
    contexts = {precision: backend.make_context(precision) for precision in ("fp32", "tf32")}
    loose = {precision: backend.make_context(precision, deterministic=False)
             for precision in ("fp32", "tf32")}
    for c, px in RESNET:
        g = conv.Geometry(args.batch, c, px, px, c, 3, 3, 1, 1, 1, 1)
        xs, ws, ys = (g.n, g.c, g.h, g.w), g.w_shape, (g.n, g.o, g.ho, g.wo)
        x, w, y = (cp.random.standard_normal(s, dtype=np.float32) for s in (xs, ws, ys))
        dy, dx, dw = (cp.random.standard_normal(s, dtype=np.float32) for s in (ys, xs, ws))
        laid = {layout: [as_layout(cp, a, layout) for a in (x, w, y, dy, dx, dw)]
                for layout in conv_cudnn.LAYOUTS}
        cp.cuda.Device().synchronize()     # made on CuPy's stream, read on the backend's
        for precision, op in ((p, o) for p in ("fp32", "tf32") for o in OPS):
            if time.perf_counter() - t0 > args.budget:
                print(f"budget spent: skipping C={c} {precision} {op}", flush=True)
                continue
            ctx = contexts[precision]
            row = {"c": c, "px": px, "precision": precision, "op": op}
            nchw = {}
            for layout in conv_cudnn.LAYOUTS:
                lx, lw, ly, ldy, ldx, ldw = laid[layout]
                paths = {"conv2d": lambda: conv_cudnn.conv2d_paths(ctx, g, lx, lw, ly,
                                                                   layout=layout),
                         "conv2d_grad_input": lambda: conv_cudnn.grad_input_paths(
                             ctx, g, ldy, lw, ldx, layout=layout),
                         "conv2d_grad_weight": lambda: conv_cudnn.grad_weight_paths(
                             ctx, g, ldy, lx, ldw, layout=layout)}[op]()
                row[layout] = time_paths(ctx, paths)
                nchw = paths if layout == "NCHW" else nchw
            ins, outs, attrs = {"conv2d": ([x, w], [y], {}),
                                "conv2d_grad_input": ([dy, w], [dx], {"input_shape": xs}),
                                "conv2d_grad_weight": ([dy, x], [dw],
                                                       {"weight_shape": ws})}[op]
            node = Node(op, [Value(a.shape, "float32") for a in ins],
                        [Value(a.shape, "float32") for a in outs],
                        {"stride": (1, 1), "padding": (1, 1)} | attrs)
            row["own"] = time_paths(ctx, own_paths(conv, ctx, node, ins, outs))
            if op == "conv2d_grad_weight":    # plans with atomics (deterministic=False)
                for layout in conv_cudnn.LAYOUTS:
                    lx, _, _, ldy, _, ldw = laid[layout]
                    row[f"{layout}_nondeterministic"] = time_paths(
                        loose[precision], conv_cudnn.grad_weight_paths(
                            loose[precision], g, ldy, lx, ldw, layout=layout))
            best = {k: min((t for t in v.values() if isinstance(t, float)), default=None)
                    for k, v in row.items() if isinstance(v, dict)}
            macs = g.n * g.o * g.p * g.c * 9
            tflops = {k: round(2 * macs / (t * 1e-6) / 1e12, 1) for k, t in best.items()
                      if t}
            row["best_us"], row["tflops"] = best, tflops
            if args.accuracy:
                ref = cp.empty_like(outs[0])
                own_paths(conv, contexts["fp32"], node, ins, [ref])["gemm"]()
                row["NCHW_rel_err"] = accuracy(ctx, nchw, outs[0], ref)
                print(f"    NCHW rel err vs exact fp32 GEMM: {row['NCHW_rel_err']}", flush=True)
            report["times"].append(row)
            print(f"C={c:3d} {px:2d}px {precision} {op:18s} best µs {best}  TFLOP/s {tflops}",
                  flush=True)
        conv_cudnn._PLANS.clear()
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "conv_layout.json").write_text(json.dumps(report, indent=1,
                                                                     default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
