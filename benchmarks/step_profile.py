"""Where one step's time goes: ``torch.profiler`` around a call, summed by kind of work
(``benchmarks/gpu.py --profile``).

On CUDA the sums are the kernels' device time (what the card computed; the step's wall time
beyond it is the card waiting on the host); on a CPU, the operators' own CPU time. A kind is
read off the kernel's or operator's name, first match wins:

- attention: flash, fmha, attention, sdpa;
- matmul: gemm, nvjet, cutlass, xmma (cuBLAS and CUTLASS kernels), ``aten::mm``, ``addmm``,
  ``bmm``;
- optimizer: adam, foreach, multi_tensor;
- copy/cast: copy, convert, cast;
- softmax/scan: softmax, logsumexp, scan, cumsum, searchsorted (a decoding step's draw, the
  head's normalisation);
- other: the rest (element-wise work, reductions, indexing).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

KINDS = (
    ("attention", ("flash", "fmha", "attention", "sdpa")),
    ("matmul", ("gemm", "nvjet", "cutlass", "xmma", "aten::mm", "aten::addmm", "aten::bmm")),
    ("optimizer", ("adam", "foreach", "multi_tensor")),
    ("copy/cast", ("copy", "convert", "cast")),
    ("softmax/scan", ("softmax", "logsumexp", "scan", "cumsum", "searchsorted")),
)


def kind_of(name: str) -> str:
    """The kind of work a kernel or operator of this name does (the module docstring)."""
    lowered = name.lower()
    for kind, marks in KINDS:
        if any(mark in lowered for mark in marks):
            return kind
    return "other"


def profile_call(work: Callable[[], Any], device: torch.device, top: int = 8) -> dict:
    """``work()`` once under the profiler: its wall seconds, the busy seconds (kernels on
    CUDA, operators' own CPU time elsewhere), those by kind, how many kernels (operators)
    ran, and the ``top`` entries."""
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        work()
        if cuda:
            torch.cuda.synchronize(device)
        wall = time.perf_counter() - start
    if cuda:
        entries = [
            (e.key, e.self_device_time_total, e.count)
            for e in prof.key_averages()
            if e.device_type == DeviceType.CUDA and e.self_device_time_total > 0
        ]
    else:
        entries = [(e.key, e.self_cpu_time_total, e.count) for e in prof.key_averages()]
    by_kind: dict[str, float] = {}
    for name, micros, _ in entries:
        by_kind[kind_of(name)] = by_kind.get(kind_of(name), 0.0) + micros / 1e6
    ranked = sorted(entries, key=lambda entry: -entry[1])[:top]
    return {
        "wall_s": wall,
        "busy_s": sum(micros for _, micros, _ in entries) / 1e6,
        "measures": "kernels on the device" if cuda else "operators' own CPU time",
        "by_kind": dict(sorted(by_kind.items(), key=lambda item: -item[1])),
        "calls": sum(count for _, _, count in entries),
        "top": [{"name": n[:100], "s": m / 1e6, "calls": c} for n, m, c in ranked],
    }


def describe(label: str, p: dict) -> str:
    """Lines for a profile: the totals and kinds, then the top entries."""
    kinds = ", ".join(f"{kind} {s:.3f}" for kind, s in p["by_kind"].items())
    lines = [
        f"  profile, {label}: {p['wall_s']:.3f} s a step, {p['measures']} {p['busy_s']:.3f} s"
        f" ({kinds})"
    ]
    lines += [f"    {t['s'] * 1e3:9.2f} ms x{t['calls']:6d}  {t['name']}" for t in p["top"]]
    return "\n".join(lines)


def describe_steps(label: str, p: dict, steps: int) -> str:
    """Lines for a profile of ``steps`` decoding steps: per step, the busy time by kind and
    the kernels (operators) launched, then the top entries per step."""
    kinds = ", ".join(f"{kind} {1e3 * s / steps:.3f}" for kind, s in p["by_kind"].items())
    lines = [
        f"  profile, {label}, per step of {steps}: {1e3 * p['wall_s'] / steps:.3f} ms, "
        f"{p['measures']} {1e3 * p['busy_s'] / steps:.3f} ms ({kinds}), "
        f"{p['calls'] / steps:.0f} launches"
    ]
    lines += [
        f"    {t['s'] * 1e6 / steps:9.1f} us x{t['calls'] / steps:6.1f}  {t['name']}"
        for t in p["top"]
    ]
    return "\n".join(lines)
