"""`jgrpo` command line: argv -> config -> library call. No logic of its own.

Commands: train, eval, export, inspect-step, convert-gguf, plot. Every invalid input ends with
exit code 2 and one line on stderr naming the key or file, before any model loads.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from datetime import datetime
from pathlib import Path

from jgrpo.config import ConfigError, format_config, load_config


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jgrpo", description="JAX-native GRPO trainer")
    sub = p.add_subparsers(dest="command", required=True)

    def with_config(name, help_text):
        sp = sub.add_parser(name, help=help_text)
        sp.add_argument("--config", required=True, help="YAML config file")
        sp.add_argument("overrides", nargs="*", help="dotted.key=value overrides")
        return sp

    train = with_config("train", "run GRPO training")
    train.add_argument("--run-dir", help="run folder (default: a fresh folder under runs/)")
    train.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    train.add_argument("--fresh", action="store_true", help="delete --run-dir contents first")
    train.add_argument("--show-config", action="store_true", help="print the resolved config")

    ev = with_config("eval", "held-out accuracy of a checkpoint or HF folder")
    ev.add_argument("--checkpoint", help="run folder or checkpoint step folder")

    insp = with_config("inspect-step", "compile the train step and report its cost")
    insp.add_argument("--json", action="store_true", help="print one JSON object")
    insp.add_argument("--no-compile", action="store_true", help="sizes only, skip compiling")

    ex = sub.add_parser("export", help="checkpoint -> HF folder")
    ex.add_argument("run_dir", help="run folder (its latest checkpoint) or a checkpoint folder")
    ex.add_argument("out", help="output HF folder")

    conv = sub.add_parser("convert-gguf", help="GGUF Llama file -> HF folder")
    conv.add_argument("src")
    conv.add_argument("out")
    conv.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])

    plot = sub.add_parser("plot", help="PNG curves of a run")
    plot.add_argument("run_dir")
    return p


def _fail(message: str) -> int:
    print(f"jgrpo: error: {message}", file=sys.stderr)
    return 2


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    from jgrpo.models.hf import ModelFormatError

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            return _dispatch(args)
    except (ConfigError, ModelFormatError, FileNotFoundError) as e:
        return _fail(str(e).splitlines()[0] if str(e) else type(e).__name__)


def _dispatch(args) -> int:
    if args.command == "convert-gguf":
        from jgrpo.models.gguf import convert_gguf

        if not Path(args.src).is_file():
            raise ConfigError(f"convert-gguf: {args.src!r} does not exist")
        print(convert_gguf(args.src, args.out, dtype=args.dtype))
        return 0
    if args.command == "plot":
        from jgrpo.metrics import plot_run

        if not (Path(args.run_dir) / "metrics.jsonl").is_file():
            raise ConfigError(f"plot: {args.run_dir!r} has no metrics.jsonl")
        for path in plot_run(args.run_dir):
            print(path)
        return 0
    if args.command == "export":
        from jgrpo.export import export_checkpoint

        print(export_checkpoint(args.run_dir, args.out))
        return 0

    cfg = load_config(args.config, args.overrides)
    if args.command == "inspect-step":
        from jgrpo.inspect_step import inspect_step

        report = inspect_step(cfg, compile=not args.no_compile)
        if not args.json:
            for key, value in report.items():
                print(f"{key:28s} {value}")
        print(json.dumps(report))
        return 0
    if args.command == "eval":
        from jgrpo.export import evaluate

        result = evaluate(cfg, args.checkpoint)
        print(json.dumps(result))
        return 0
    return _train(cfg, args)


def _fresh_run_dir(root: Path) -> Path:
    """runs/<timestamp>, with a suffix when that name is taken."""
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    candidate, n = root / stamp, 1
    while candidate.exists():
        candidate, n = root / f"{stamp}-{n}", n + 1
    return candidate


def _train(cfg, args) -> int:
    if args.show_config:
        print(format_config(cfg))
        return 0
    from jgrpo import train

    train.check_run(cfg)
    run_dir = Path(args.run_dir) if args.run_dir else _fresh_run_dir(Path("runs"))
    if args.resume and not (run_dir / "checkpoints").is_dir():
        raise ConfigError(f"--resume: {str(run_dir)!r} has no checkpoints/ folder")
    if not (args.resume or args.fresh) and (run_dir / "metrics.jsonl").exists():
        raise ConfigError(
            f"--run-dir: {str(run_dir)!r} already holds a run; pass --resume to continue it "
            "or --fresh to delete it"
        )
    if args.fresh and run_dir.exists():
        import shutil

        shutil.rmtree(run_dir)
    try:
        history = train.run(cfg, run_dir, resume=args.resume)
    except train.RunStopped as e:
        print(f"jgrpo: stopped: {e}", file=sys.stderr)
        return 1
    train.write_summary(run_dir, history)
    print(train.summarize(history))
    print(f"run folder: {run_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
