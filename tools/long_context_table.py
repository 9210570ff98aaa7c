"""How a recipe's train step grows with row length: `jgrpo inspect-step` at several completion
lengths, nothing allocated (the step compiled on abstract arrays, `jgrpo.inspect_step`).

For each length L, rollout.max_new_tokens = L (the recipe's prompt_bucket kept): the step's
per-device temporaries (XLA's `temp_size_in_bytes`), its peak estimate, the sampler's KV cache
share per device and the total against the device (inspect-step's `device_bytes_needed`).
`--materialised` adds the same at model.attention_block_size = 0 (t x t scores) for comparison.
Prints a markdown table (GB = 10^9 bytes) and one JSON line per compile. Run with as many
fake devices as the recipe's mesh has (the flags below are set before jax is imported):

    python tools/long_context_table.py --config configs/qwen3_4b_32k_long.yaml \
        --devices 8 --lengths 4096,8192,16384,32768 model.path=FOLDER
"""

from __future__ import annotations

import argparse
import json
import os


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--devices", type=int, default=8, help="fake CPU devices (the recipe's mesh)")
    ap.add_argument("--lengths", default="4096,8192,16384,32768", help="completion lengths")
    ap.add_argument("--materialised", default="", help="lengths also sized with t x t scores")
    ap.add_argument("--device-memory", default="80gb", help="the device's size")
    ap.add_argument("overrides", nargs="*", help="dotted config overrides (model.path=...)")
    args = ap.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    flag = f"--xla_force_host_platform_device_count={args.devices}"
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()

    from jgrpo.config import load_config
    from jgrpo.inspect_report import device_fit, parse_device_memory
    from jgrpo.inspect_step import inspect_step

    memory = parse_device_memory(args.device_memory)
    runs = [(int(n), "blockwise") for n in args.lengths.split(",") if n]
    runs += [(int(n), "materialised") for n in args.materialised.split(",") if n]
    rows = []
    for new_tokens, attention in runs:
        extra = [f"rollout.max_new_tokens={new_tokens}"]
        extra += ["model.attention_block_size=0"] if attention == "materialised" else []
        cfg = load_config(args.config, [*args.overrides, *extra])
        report = inspect_step(cfg)
        report |= device_fit(report, memory)
        row = {
            "tokens": cfg.rollout.prompt_bucket + new_tokens,
            "attention": attention,
            **{k: report[k] for k in KEYS},
        }
        print(json.dumps(row), flush=True)
        rows.append(row)
    print("| row tokens | attention | temporaries | step peak | KV cache | total |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        cells = " | ".join(f"{r[k] / 1e9:.2f}" for k in KEYS)
        print(f"| {r['tokens']:,} | {r['attention']} | {cells} |")


KEYS = (
    "temp_bytes_per_device",
    "peak_bytes_per_device_estimate",
    "kv_cache_bytes_per_device",
    "device_bytes_needed",
)


if __name__ == "__main__":
    main()
