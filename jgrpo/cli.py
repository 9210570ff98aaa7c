"""`jgrpo` command line: argv -> config -> library call, and the run folder's safety rules.

Commands: train, sft, eval, export, inspect-step, convert-gguf, plot. Every invalid input ends with
exit code 2 and one line on stderr naming the key or file, before any model loads; the checks
that need no jax (config, run folder, model folder, data) run before jax is imported, so a
rejected invocation takes well under a second. Ctrl-C exits 130 with one line. Warnings print
as one line each (`jgrpo: warning: ...`).

Run folders: `train` writes the marker file `.jgrpo-run` into every run folder it creates.
`--fresh` deletes a folder only when it is recognisably a jgrpo run: it holds the marker,
config.yaml, metrics.jsonl or checkpoints/, and nothing else than the entries a run writes
(:data:`RUN_ENTRIES`); it deletes only after every check passed, and never with `--resume`.
A non-empty folder that is not a run is never trained into either.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
import warnings
from datetime import datetime
from pathlib import Path

from jgrpo.config import ConfigError, check_resume_compatible, format_config, load_config, read_yaml
from jgrpo.console import console_lines

log = logging.getLogger("jgrpo")

RUN_MARKER = ".jgrpo-run"
"""Empty file `train` writes into each run folder it creates."""
RUN_ENTRIES = frozenset(
    {
        RUN_MARKER,
        "config.yaml",
        "metrics.jsonl",
        "samples.jsonl",
        "summary.json",
        "checkpoints",
        "final",
        "hf",
        "tb",
        "plots",
        "wandb",
    }
)
"""Every name a jgrpo run writes at the top of its folder (`tests/test_cli.py` checks a run
with every writer on against it). Their temporaries count too: `NAME.tmp` (`write_atomic`) and
`.NAME.*.partial` / `.NAME.*.old` (`atomic_folder`)."""
_TEMPORARY = re.compile(r"^\.?(?P<name>[^/]+?)(\.tmp|\.[^.]+\.(partial|old))$")


def is_run_entry(name: str) -> bool:
    """True for an entry a jgrpo run writes at the top of its folder, temporaries included."""
    if name in RUN_ENTRIES:
        return True
    temporary = _TEMPORARY.match(name)
    return temporary is not None and temporary["name"] in RUN_ENTRIES


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("jgrpo")
    except PackageNotFoundError:  # a source tree on PYTHONPATH, not installed
        from jgrpo import __version__

        return __version__


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jgrpo", description="JAX-native GRPO trainer")
    p.add_argument("--version", action="version", version=f"jgrpo {_version()}")
    loudness = argparse.ArgumentParser(add_help=False)
    group = loudness.add_mutually_exclusive_group()
    group.add_argument(
        "-v", "--verbose", action="store_true", help="also per-step timings, each line timed"
    )
    group.add_argument(
        "-q", "--quiet", action="store_true", help="warnings and errors only, no progress bar"
    )
    sub = p.add_subparsers(dest="command", required=True)

    def with_config(name, help_text):
        sp = sub.add_parser(name, help=help_text, parents=[loudness])
        sp.add_argument("--config", required=True, help="YAML config file")
        sp.add_argument("overrides", nargs="*", help="dotted.key=value overrides")
        return sp

    for name, help_text in (("train", "run GRPO training"), ("sft", "supervised fine-tuning")):
        train = with_config(name, help_text)
        train.add_argument("--run-dir", help="run folder (default: a fresh folder under runs/)")
        train.add_argument(
            "--resume", action="store_true", help="continue from the latest checkpoint"
        )
        train.add_argument("--fresh", action="store_true", help="delete --run-dir contents first")
        train.add_argument("--show-config", action="store_true", help="print the resolved config")
        pod = train.add_argument_group("multi-host pod (one process per host; see docs/pods.md)")
        pod.add_argument("--coordinator", metavar="HOST:PORT", help="process 0's address")
        pod.add_argument("--num-processes", type=int, metavar="N", help="processes in the pod")
        pod.add_argument("--process-id", type=int, metavar="I", help="this process, 0..N-1")
        pod.add_argument(
            "--peer-timeout", type=float, metavar="S", help="seconds before a silent peer is lost"
        )

    ev = with_config("eval", "held-out accuracy of a checkpoint or HF folder")
    ev.add_argument("--checkpoint", help="run folder or checkpoint step folder")

    insp = with_config("inspect-step", "compile the train step and report its cost")
    insp.add_argument("--json", action="store_true", help="print one JSON object")
    insp.add_argument("--no-compile", action="store_true", help="sizes only, skip compiling")
    insp.add_argument(
        "--lengths",
        metavar="SPEC",
        help="completion lengths (uniform | skewed | L1,L2,...): real vs padded vs packed "
        "tokens and flops of the step",
    )
    insp.add_argument(
        "--device-memory",
        metavar="SIZE",
        help="a device's memory, a number and a unit (MB, GB, TB, MiB, GiB, TiB): whether the step "
        "fits one device, and by how much",
    )

    ex = sub.add_parser("export", help="checkpoint -> HF folder", parents=[loudness])
    ex.add_argument("run_dir", help="run folder (its latest checkpoint) or a checkpoint folder")
    ex.add_argument("out", help="output HF folder")
    ex.add_argument("--overwrite", action="store_true", help="replace a non-empty OUT (atomically)")
    ex.add_argument(
        "--adapter", action="store_true", help="LoRA runs: the adapters alone, in PEFT format"
    )

    conv = sub.add_parser("convert-gguf", help="GGUF Llama file -> HF folder", parents=[loudness])
    conv.add_argument("src")
    conv.add_argument("out")
    conv.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    conv.add_argument("--overwrite", action="store_true", help="replace an existing OUT")

    plot = sub.add_parser("plot", help="PNG curves of a run", parents=[loudness])
    plot.add_argument("run_dir")
    return p


TRAINS = ("train", "sft")
"""Commands that train into a run folder (same folder rules, resume, pods)."""


def _fail(message: str) -> int:
    print(f"jgrpo: error: {message}", file=sys.stderr)
    return 2


def _one_line_warning(message, category, filename, lineno, file=None, line=None):
    text = str(message).strip().splitlines()
    log.warning("warning: %s", text[0] if text else category.__name__)  # above a progress bar


def _user_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that mean bad input: ConfigError and file errors, plus ModelFormatError
    when the model code was imported (importing it here would import jax)."""
    kinds: list[type[BaseException]] = [ConfigError, FileNotFoundError, FileExistsError]
    hf = sys.modules.get("jgrpo.models.hf")
    if hf is not None:
        kinds.append(hf.ModelFormatError)
    return tuple(kinds)


def _parse(argv) -> argparse.Namespace:
    """argparse, but overrides may also follow flags (`--config X a=1 --run-dir R b=2`)."""
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    late = [a for a in extra if "=" in a and not a.startswith("-")]
    if extra and (late != extra or not hasattr(args, "overrides")):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if late:
        args.overrides = [*args.overrides, *late]
    return args


def main(argv=None) -> int:
    args = _parse(argv)
    level = logging.DEBUG if args.verbose else logging.WARNING if args.quiet else logging.INFO
    with console_lines(level):
        return _main(args)


def _main(args) -> int:
    # orbax reports a damaged step it skips through absl warnings; the CLI says it in one line.
    logging.getLogger("absl").setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = _one_line_warning
            return _dispatch(args)
    except KeyboardInterrupt:
        print("jgrpo: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if not isinstance(e, _user_errors()):
            raise
        return _fail(str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__)


def _dispatch(args) -> int:
    if args.command == "convert-gguf":
        return _convert_gguf(args)
    if args.command == "plot":
        return _plot(args)
    if args.command == "export":
        from jgrpo.export import check_checkpoint_source, export_checkpoint

        check_output_folder(args.out, args.overwrite, "export")
        cfg = check_checkpoint_source(args.run_dir)
        _check_model_and_data(cfg, data=False)
        if args.adapter and cfg.model.lora.rank == 0:
            raise ConfigError("export --adapter: the run has no LoRA adapters (model.lora.rank=0)")
        print(
            export_checkpoint(
                args.run_dir, args.out, overwrite=args.overwrite, adapter=args.adapter
            )
        )
        return 0

    from jgrpo.tasks.child import add_user_folders

    add_user_folders(args.config)  # reward, tool and environment modules found as by Python
    memory = None
    if args.command == "inspect-step" and args.device_memory is not None:
        from jgrpo.inspect_report import parse_device_memory

        memory = parse_device_memory(args.device_memory)
    quiet = ["logging.progress_bar=false"] if args.quiet and args.command in TRAINS else []
    cfg = load_config(args.config, [*args.overrides, *quiet])
    from jgrpo.xla_flags import set_gpu_flags

    set_gpu_flags()  # on GPU only; before anything starts a JAX backend
    if args.command == "inspect-step":
        from jgrpo.inspect_report import device_fit, format_report
        from jgrpo.inspect_step import inspect_step

        report = inspect_step(cfg, compile=not args.no_compile, lengths=args.lengths)
        if args.json:
            print(json.dumps(report | (device_fit(report, memory) if memory else {})))
        else:
            print(format_report(report, memory and (memory, args.device_memory)))
        return 0
    if args.command == "eval":
        _check_model_and_data(cfg)
        from jgrpo.export import check_checkpoint_source, evaluate

        if args.checkpoint is not None:
            check_checkpoint_source(args.checkpoint, cfg)

        from jgrpo.evaluation import format_table

        result = evaluate(cfg, args.checkpoint)
        print(format_table({k: v for k, v in result.items() if k.startswith("val/")}))
        print(json.dumps(result))
        return 0
    return _train(cfg, args)


def _convert_gguf(args) -> int:
    src = Path(args.src)
    if not src.is_file():
        raise ConfigError(f"convert-gguf: {args.src!r} does not exist")
    check_output_folder(args.out, args.overwrite, "convert-gguf")
    from jgrpo.models.gguf import convert_gguf

    try:
        out = convert_gguf(src, args.out, dtype=args.dtype, overwrite=args.overwrite)
    except ValueError as e:
        raise ConfigError(f"convert-gguf: {e}") from None
    print(out)
    return 0


def _plot(args) -> int:
    from jgrpo.metrics import read_metrics
    from jgrpo.plots import plot_run

    file = Path(args.run_dir) / "metrics.jsonl"
    if not file.is_file():
        raise ConfigError(f"plot: {args.run_dir!r} has no metrics.jsonl")
    if not read_metrics(file):
        raise ConfigError(f"plot: {str(file)!r} holds no metrics lines")
    for path in plot_run(args.run_dir):
        print(path)
    return 0


def check_output_folder(out: str | Path, overwrite: bool, what: str) -> None:
    """OUT of export / convert-gguf: absent or an empty folder, or `overwrite` of a folder."""
    out = Path(out)
    for parent in out.absolute().parents:
        if parent.exists() and not parent.is_dir():
            raise ConfigError(f"{what}: {str(out)!r} lies under the file {str(parent)!r}")
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{what}: {str(out)!r} is a file, not a folder")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ConfigError(
            f"{what}: {str(out)!r} is not empty; pass --overwrite to replace it (atomically)"
        )


def _check_model_and_data(cfg, data: bool = True, sft: bool = False) -> None:
    """The checks that need no jax: data, then the model folder (headers, shapes, tokenizer);
    data first, so a bad data option is named before a model download of gigabytes. `sft`:
    also sft.train_path / sft.val_path are read, and the model is sized for sft.max_seq_length."""
    from jgrpo.config.rules import needs_chat_turns
    from jgrpo.models.preflight import check_lora_targets
    from jgrpo.models.sources import check_model_path

    if data:
        from jgrpo.tasks import run_task

        run_task(cfg)
    if sft:
        from jgrpo.tasks.data import load_table

        for key in ("train_path", "val_path"):
            path = getattr(cfg.sft, key)
            if path is not None:
                load_table(path, f"sft.{key}", key.removesuffix("_path"), cfg.sft.dataset_config)
        check_model_path(cfg.model.path, cfg.sft.max_seq_length)
        return
    length = cfg.rollout.prompt_bucket + cfg.rollout.max_new_tokens
    hf = check_model_path(cfg.model.path, length, multi_turn=data and needs_chat_turns(cfg))
    check_lora_targets(hf, cfg.model.lora)


def run_folder_kind(run_dir: Path) -> str:
    """ "absent", "empty", "run" (only entries a jgrpo run writes) or "foreign:<name>"."""
    if not run_dir.exists():
        return "absent"
    names = sorted(p.name for p in run_dir.iterdir())
    if not names:
        return "empty"
    foreign = [n for n in names if not is_run_entry(n)]
    if foreign:
        return f"foreign:{foreign[0]}"
    if {RUN_MARKER, "config.yaml", "metrics.jsonl", "checkpoints"} & set(names):
        return "run"
    return f"foreign:{names[0]}"


def check_run_dir(run_dir: Path, resume: bool, fresh: bool) -> None:
    """--run-dir / --resume / --fresh rules; raises ConfigError, touches nothing."""
    if resume and fresh:
        raise ConfigError("--resume and --fresh: choose one (--fresh would delete the run)")
    where = str(run_dir)
    for parent in run_dir.absolute().parents:
        if parent.exists():
            if not parent.is_dir():
                raise ConfigError(f"--run-dir: {where!r} lies under the file {str(parent)!r}")
            if not run_dir.exists() and not os.access(parent, os.W_OK | os.X_OK):
                raise ConfigError(
                    f"--run-dir: cannot create {where!r}: {str(parent)!r} is not writable"
                )
            break
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"--run-dir: {where!r} is a file, not a folder")
    if run_dir.exists() and not os.access(run_dir, os.W_OK | os.X_OK):
        raise ConfigError(f"--run-dir: {where!r} is not writable")
    kind = run_folder_kind(run_dir)
    if resume:
        if not (run_dir / "checkpoints").is_dir():
            raise ConfigError(f"--resume: {where!r} has no checkpoints/ folder")
        return
    if kind.startswith("foreign:"):
        raise ConfigError(
            f"--run-dir: {where!r} is not a jgrpo run folder (it holds "
            f"{kind.removeprefix('foreign:')!r}); choose an empty or new folder"
            + ("; --fresh deletes only run folders" if fresh else "")
        )
    if kind == "run" and not fresh and (run_dir / "metrics.jsonl").exists():
        raise ConfigError(
            f"--run-dir: {where!r} already holds a run; pass --resume to continue it "
            "or --fresh to delete it"
        )


def _check_resume_config(cfg, run_dir: Path) -> None:
    saved = run_dir / "config.yaml"
    if not saved.is_file():
        raise ConfigError(f"--resume: {str(saved)!r} does not exist (cannot compare configs)")
    check_resume_compatible(read_yaml(saved, "run config"), cfg, repr(str(saved)))


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
    from jgrpo import distributed

    spec = distributed.resolve_spec(
        args.coordinator, args.num_processes, args.process_id, args.peer_timeout
    )
    run_dir = Path(args.run_dir) if args.run_dir else _fresh_run_dir(Path("runs"))
    check_run_dir(run_dir, args.resume, args.fresh)
    if args.resume:
        _check_resume_config(cfg, run_dir)
    sft = args.command == "sft"
    _check_model_and_data(cfg, sft=sft)
    log.debug("importing jax")
    distributed.initialize(spec)  # before anything touches a device (the checks above need none)
    from jgrpo import train
    from jgrpo.tasks.child import UserCodeError

    if sft:
        from jgrpo import sft as trainer
    else:
        trainer = train
    trainer.check_run(cfg)
    # Every check passed: only now may --fresh delete (a recognised run folder, see above).
    if args.fresh and run_folder_kind(run_dir) == "run" and distributed.is_primary():
        import shutil

        shutil.rmtree(run_dir)
        log.info("--fresh: deleted the earlier run in %s", run_dir)
    distributed.barrier("run-dir")  # every process checked run_dir before process 0 writes it
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / RUN_MARKER).touch()
    except OSError as e:
        raise ConfigError(f"--run-dir: cannot write {str(run_dir)!r} ({e.strerror})") from None
    log.info("run folder %s", run_dir)  # every check passed: what follows is the run
    try:
        history = trainer.run(cfg, run_dir, resume=args.resume)
    except (train.RunStopped, UserCodeError) as e:  # UserCodeError: data.reward_errors: raise
        print(f"jgrpo: stopped: {e}", file=sys.stderr)
        if isinstance(e, UserCodeError) and distributed.is_multiprocess():
            distributed.abort(1)  # one host's rows failed: its peers wait on it in a collective
        return 1
    except BaseException:
        if distributed.is_multiprocess():  # peers may wait on this process: do not linger
            import traceback

            traceback.print_exc()
            distributed.abort(1)
        raise
    distributed.finish()
    if not distributed.is_primary():
        return 0
    print(trainer.summarize(history))
    print(f"run folder: {run_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
