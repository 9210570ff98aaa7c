"""The text form of `jgrpo inspect-step`'s report and its verdict against a device size.

`format_report(report, device_memory)` prints each key of `jgrpo.inspect_step.inspect_step`'s
report (the --json keys, unchanged) with its value in human units: bytes in GiB (2^30), flops
in TFLOP (10^12), parameter counts in M / B. `parse_device_memory("80GiB")` reads
`--device-memory` (MB / GB / TB powers of 10, MiB / GiB / TiB powers of 2; ConfigError naming
the flag otherwise); `device_bytes_needed` is what one device holds while training (the
compiled step's peak + its KV cache share + reward models) and `device_verdict` says whether
that fits, with the bytes left or missing. Imports no jax: the CLI checks the flag first.
"""

from __future__ import annotations

import re

from jgrpo.config import ConfigError

_UNIT_BYTES = {"mb": 10**6, "gb": 10**9, "tb": 10**12, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?)\s*([a-zA-Z]+)\s*")


def parse_device_memory(text: str) -> int:
    """Bytes of a device size (`--device-memory`): a positive number and a unit, MB / GB / TB
    (powers of 10) or MiB / GiB / TiB (powers of 2), any case, a space between or not."""
    found = _SIZE.fullmatch(text)
    unit = _UNIT_BYTES.get(found.group(2).lower()) if found else None
    if unit is None or float(found.group(1)) <= 0:
        raise ConfigError(
            f"--device-memory: {text!r} is not a size: a positive number and one of the "
            "units MB, GB, TB, MiB, GiB, TiB (such as 80GiB)"
        )
    return int(float(found.group(1)) * unit)


def device_bytes_needed(report: dict) -> tuple[int, bool]:
    """(bytes one device holds while training, whether that is the whole need): the compiled
    step's peak (arguments + outputs - donated aliases + temporaries), the device's share of
    the sampler's KV cache and its reward models. Without compiling (`compile=False`) there
    are no temporaries: params + optimizer state + reference + teacher + KV share + reward
    models, a lower bound (False)."""
    extra = report["kv_cache_bytes_per_device"] + report["reward_model_bytes_per_device"]
    if "peak_bytes_per_device_estimate" in report:
        return report["peak_bytes_per_device_estimate"] + extra, True
    held = sum(
        report[k]
        for k in (
            "param_bytes_per_device",
            "opt_state_bytes_per_device",
            "ref_param_bytes_per_device",
        )
    )
    held += report.get("teacher_param_bytes_per_device", 0)
    return held + extra, False


def device_fit(report: dict, device_memory: int) -> dict:
    """The JSON keys `--device-memory` adds: the device's bytes, `device_bytes_needed` and
    whether it fits (False when it does not or, without compiling, may not)."""
    need, whole = device_bytes_needed(report)
    return {
        "device_memory_bytes": device_memory,
        "device_bytes_needed": need,
        "device_fits": whole and need <= device_memory,
    }


def format_bytes(n: float) -> str:
    """`n` bytes in GiB (2^30) from 1 GiB, else MiB, KiB or B: `18.63 GiB`."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def format_flops(n: float) -> str:
    """`n` flops in TFLOP (10^12) from 1 TFLOP, else GFLOP or MFLOP: `3.21 TFLOP`."""
    scales = (("TFLOP", 1e12), ("GFLOP", 1e9))
    unit, size = next(((u, s) for u, s in scales if abs(n) >= s), ("MFLOP", 1e6))
    x = n / size
    return f"{x:.3g} {unit}" if abs(x) < 1000 else f"{x:,.0f} {unit}"


def format_count(n: int) -> str:
    """A parameter count in B / M / K with the exact number: `494.0M (494,032,768)`."""
    for unit, size in (("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= size:
            return f"{n / size:.{2 if unit == 'B' else 1}f}{unit} ({n:,})"
    return str(n)


def _format_value(key: str, value) -> str:
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return str(value)
    if isinstance(value, dict):
        return " x ".join(f"{k} {v}" for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return ", ".join(map(str, value)) or "none"
    if key == "seconds":
        return f"{value:.1f} s"
    if "_bytes" in key:
        return format_bytes(value)
    if key.startswith("flops"):
        return format_flops(value)
    if key.startswith("num_") and key.endswith("params"):
        return format_count(value)
    return f"{value:,}" if isinstance(value, int) else f"{value:.4g}"


def device_verdict(report: dict, device_memory: int, label: str) -> str:
    """One line: whether a device of `device_memory` bytes (`label`, as the user wrote it)
    holds what `device_bytes_needed` counts, with the bytes left (and their share) or missing."""
    need, whole = device_bytes_needed(report)
    what = (
        f"each device needs {'' if whole else 'at least '}{format_bytes(need)} of {label} "
        f"({format_bytes(device_memory)})"
    )
    if need > device_memory:
        return f"does not fit: {what}, {format_bytes(need - device_memory)} over"
    left = device_memory - need
    head = "fits" if whole else "may fit (without compiling, temporaries are not counted)"
    return f"{head}: {what}, {format_bytes(left)} ({left / device_memory:.0%}) left"


def format_report(report: dict, device_memory: tuple[int, str] | None = None) -> str:
    """The text of `jgrpo inspect-step` (no --json): each report key with its value in human
    units (GiB, TFLOP, M/B parameters), then, given `device_memory` (bytes, label), the
    verdict of `device_verdict`."""
    lines = [f"{key:34s} {_format_value(key, value)}" for key, value in report.items()]
    if device_memory is not None:
        lines.append(f"{'verdict':34s} {device_verdict(report, *device_memory)}")
    return "\n".join(lines)
