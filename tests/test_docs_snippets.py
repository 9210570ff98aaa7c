"""The new-user walkthrough: every fenced block of README.md and docs/*.md runs as printed, from
a fresh clone and from a working folder outside the checkout.

How a block is taken (a marker is an HTML comment on the line before the fence; it never shows):
- ```text: shown, not run (an output sample, a folder layout, a shape legend).
- `<!-- not run: WHY -->`: not run, for the reason given (a cluster job script).
- `<!-- file: PATH -->`: its text is written to PATH in the page's working folder (a data file).
- python whose first line is `# NAME.py`: written to NAME.py in the page's working folder (a
  fresh folder outside the checkout, one per page), then imported there.
- other python: run by `python -c` in the page's working folder, after the page's files are
  written. A block that calls `.train(` trains, so it runs under `heavy`.
- yaml: a config file on top of the defaults, as `jgrpo train --config` reads it: validated,
  then the checks the CLI makes before training (data files, rewards that import, tools, the
  model and its positions), in the page's working folder. `<!-- checked only: WHY -->` stops
  after validation (a hub id that downloads when online); `<!-- on every shipped config -->`
  validates it on top of each configs/*.yaml instead of the defaults (an agent's config, whose
  rollout may make several rows, is left out: DAPO's dynamic sampling is not allowed there).
- bash: one command per line (backslash continuations joined, comments dropped), run in a copy
  of the checkout's tracked files (what a fresh clone holds), in order:
  - `make TARGET`: the Makefile has TARGET; not run (each sets up .venv, most train for minutes);
  - `python tools/X.py ...`: tools/X.py exists and names each --flag; not run (benchmarks and
    the warm start run for minutes);
  - `jgrpo ...` with placeholders (FILE, RUN_DIR, HOST0:PORT, `[optional parts]`) is a
    synopsis: the subcommand and each --flag exist in the CLI's parser;
  - `jgrpo ...` without placeholders runs as printed and must exit 0: `--show-config` in the
    quick part, the rest (training, compiling, plotting) under `heavy`. `<!-- checked only: WHY
    -->` checks every line as a synopsis instead (a measurement that runs for minutes).
An unmarked block the walkthrough cannot take fails `test_every_block_is_run_or_marked`."""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml
from conftest import xla_flags

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
MARKERS = "not run|file|checked only|on every shipped config"
MARKER = re.compile(rf"<!--\s*({MARKERS})\s*:?\s*(.*?)\s*-->")
MODULE_LINE = re.compile(r"#\s*([\w/]+\.py)\s*$")
PLACEHOLDER = re.compile(r"^[A-Z][A-Z0-9_]*(\.gguf)?$")
RUN_TIMEOUT_S = 900


@dataclasses.dataclass(frozen=True)
class Block:
    """One fenced block of a page, with the marker on the line before its fence."""

    page: str
    """The page, relative to the checkout (README.md, docs/rewards.md)."""
    line: int
    """1-based line of the opening fence."""
    lang: str
    """The fence's info string ("" when none)."""
    text: str
    """The block's lines, dedented."""
    marker: str = ""
    """"not run", "file", "checked only", "on every shipped config" or ""."""
    note: str = ""
    """The marker's text: the reason, or the file's path."""

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def module(self) -> str | None:
        """NAME.py when a python block's first line is `# NAME.py`."""
        first = self.text.lstrip().split("\n", 1)[0]
        match = MODULE_LINE.fullmatch(first.strip()) if self.lang == "python" else None
        return match.group(1) if match else None


def read_blocks(path: Path, root: Path = REPO) -> list[Block]:
    """Every fenced block of a markdown page, in order."""
    lines = path.read_text().split("\n")
    blocks, i = [], 0
    while i < len(lines):
        fence = lines[i].strip()
        if not fence.startswith("```"):
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip().startswith("```"))
        before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        match = MARKER.search(before)
        blocks.append(
            Block(
                page=str(path.relative_to(root)),
                line=i + 1,
                lang=fence[3:].strip(),
                text=textwrap.dedent("\n".join(lines[i + 1 : end])) + "\n",
                marker=match.group(1) if match else "",
                note=match.group(2) if match else "",
            )
        )
        i = end + 1
    return blocks


BLOCKS = [b for page in PAGES for b in read_blocks(page)]


def commands(text: str) -> list[str]:
    """A bash block's commands: continuations joined, comments and blank lines dropped."""
    joined = re.sub(r"\\\n", " ", text)
    out = []
    for line in joined.split("\n"):
        line = line.split(" #", 1)[0].strip()
        if line and not line.startswith("#"):
            out.append(line)
    return out


def program(command: str) -> list[str]:
    """The command's words without leading NAME=value settings and a `flock LOCK` prefix."""
    words = shlex.split(command)
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
        words = words[1:]
    if words[:1] == ["flock"]:
        words = words[2:]
    return words


def is_synopsis(words: list[str]) -> bool:
    """A command with placeholders: FILE, RUN_DIR, HOST0:PORT, model.path=FOLDER, [parts]."""
    for word in words:
        if "[" in word or "]" in word or "..." in word or word == "|":
            return True
        if any(PLACEHOLDER.match(part) for part in re.split(r"[=:]", word)):
            return True
    return False


def command_kind(block: Block, command: str) -> str:
    """make | tool | synopsis | show-config | run, or "unknown: ..." for a command not taken."""
    words = program(command)
    if words[:1] == ["make"]:
        return "make"
    if words[:1] == ["python"] and len(words) > 1 and words[1].startswith("tools/"):
        return "tool"
    if words[:1] != ["jgrpo"]:
        return f"unknown: {command!r} is neither make, python tools/X.py nor jgrpo"
    if is_synopsis(words) or block.marker == "checked only":
        return "synopsis"
    return "show-config" if "--show-config" in words else "run"


def block_kind(block: Block) -> str:
    """How the walkthrough takes a block (see the module docstring), or "unknown: ..."."""
    if block.lang == "text" or block.marker == "not run":
        return "shown" if block.note or block.lang == "text" else "unknown: `not run` gives no why"
    if block.marker == "file":
        return "file"
    if block.lang == "python":
        if block.module:
            return "module"
        return "train" if ".train(" in block.text else "script"
    if block.lang == "yaml":
        return "yaml"
    if block.lang == "bash":
        kinds = [command_kind(block, c) for c in commands(block.text)]
        bad = [k for k in kinds if k.startswith("unknown")]
        if bad:
            return bad[0]
        return "bash-run" if "run" in kinds else "bash"
    return f"unknown: a ```{block.lang or '(no language)'} block"


KNOWN_DEFECTS: dict[tuple[tuple[str, str], str], str] = {}
"""((page, language), text in the block) -> why the block fails for a product defect another
change fixes (xfail, not strict: remove the entry once it passes)."""


def of_kind(*kinds: str) -> list:
    params = []
    for b in BLOCKS:
        if block_kind(b) not in kinds:
            continue
        why = [
            w
            for (page, text), w in KNOWN_DEFECTS.items()
            if (b.page, b.lang) == page and text in b.text
        ]
        marks = [pytest.mark.xfail(reason=why[0], strict=False)] if why else []
        params.append(pytest.param(b, id=b.id, marks=marks))
    return params


def test_every_block_is_run_or_marked():
    bad = [f"{b.id}: {block_kind(b)}" for b in BLOCKS if block_kind(b).startswith("unknown")]
    why = "blocks the walkthrough cannot run (mark them, see this test's docstring)"
    assert not bad, why + ":\n" + "\n".join(bad)
    assert {block_kind(b) for b in BLOCKS} >= {"module", "script", "train", "yaml", "bash"}


# ---- the page's working folder (outside the checkout) -------------------------------------


def child_env() -> dict:
    """A user's environment: one CPU device and the checkout's jgrpo (the PYTHONPATH of this
    process, nothing added: a page's modules are found as the user's would be, `python -c` in
    the page's folder putting it on sys.path)."""
    return dict(os.environ, XLA_FLAGS=xla_flags(None), JAX_PLATFORMS="cpu")


def page_folder(tmp_path: Path, page: str) -> Path:
    """A fresh working folder outside the checkout holding the page's files and modules."""
    folder = tmp_path / "work"
    folder.mkdir()
    assert REPO not in folder.resolve().parents
    for b in BLOCKS:
        if b.page != page:
            continue
        name = b.note if b.marker == "file" else b.module if block_kind(b) == "module" else None
        if name:
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            (folder / name).write_text(b.text)
    return folder


def run_python(code: str, folder: Path, timeout: int = RUN_TIMEOUT_S) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=folder,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-4000:] + proc.stdout[-2000:]


@pytest.mark.parametrize("block", of_kind("module"))
def test_module_block_imports(block, tmp_path):
    folder = page_folder(tmp_path, block.page)
    name = block.module.removesuffix(".py").replace("/", ".")
    run_python(f"import {name}", folder, timeout=120)


@pytest.mark.parametrize("block", of_kind("script"))
def test_python_block_runs(block, tmp_path):
    run_python(block.text, page_folder(tmp_path, block.page))


REWARD_MODEL_ID = "Skywork/Skywork-Reward-V2-Qwen3-0.6B"
"""The reward model the docs name: a tiny random Qwen3 classifier stands in for it."""


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory):
    """HF_HOME holding the docs' reward model, as `hf download ID` leaves it (docs/reward-
    models.md: a hub id is read from the local cache): a stand-in served on 127.0.0.1."""
    from conftest import build_reward_model
    from hub_server import HubServer

    home = tmp_path_factory.mktemp("hf")
    folder = build_reward_model(home / "stand-in", "qwen3")
    files = {p.name: p.read_bytes() for p in folder.iterdir()}
    with HubServer({("model", REWARD_MODEL_ID): files}) as server:
        env = {"HF_HOME": str(home), "HF_ENDPOINT": server.endpoint, "HF_HUB_OFFLINE": "0"}
        code = f"import huggingface_hub as h; h.snapshot_download({REWARD_MODEL_ID!r})"
        subprocess.run([sys.executable, "-c", code], env=os.environ | env, check=True)
    return home


@pytest.mark.heavy
@pytest.mark.parametrize("block", of_kind("train"))
def test_python_block_trains(block, tmp_path, hub_cache, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(hub_cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    run_python(block.text, page_folder(tmp_path, block.page))


YAML_CHECK = """
import os, sys
sys.path[:] = [p for p in sys.path if p not in ("", os.getcwd())]  # as the `jgrpo` script runs
from jgrpo.cli import _check_model_and_data
from jgrpo.tasks.child import add_user_folders
add_user_folders(sys.argv[1])  # the CLI's start: the working folder and the config's folder
from jgrpo.config import load_config, read_yaml, apply_overrides, from_dict, validate, Config
snippet, bases, deep = sys.argv[1], sys.argv[2:-1], sys.argv[-1] == "deep"
if not bases:
    cfg = load_config(snippet)
for base in bases:  # the block's keys on top of each shipped config
    def merge(a, b):
        return {k: merge(a[k], v) if isinstance(v, dict) and isinstance(a.get(k), dict) else v
                for k, v in {**a, **b}.items()}
    cfg = validate(from_dict(Config, merge(read_yaml(base) or {}, read_yaml(snippet) or {})))
if deep:
    _check_model_and_data(cfg)
"""


@pytest.mark.parametrize("block", of_kind("yaml"))
def test_yaml_block_is_a_config_that_passes_the_cli_checks(block, tmp_path):
    folder = page_folder(tmp_path, block.page)
    (folder / "snippet.yaml").write_text(block.text)
    bases = []
    if block.marker == "on every shipped config":
        shipped = sorted((REPO / "configs").glob("*.yaml"))
        bases = [
            str(p)
            for p in shipped
            if "agent" not in (yaml.safe_load(p.read_text()).get("data") or {})
        ]
    deep = "shallow" if block.marker == "checked only" or bases else "deep"
    proc = subprocess.run(
        [sys.executable, "-c", YAML_CHECK, "snippet.yaml", *bases, deep],
        cwd=folder,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


TRAIN_SMALL = ["grpo.max_num_steps=2", "grpo.num_prompts_per_step=2", "grpo.val_period=0"]
"""The test's overrides of a YAML block it trains: fewer steps and prompts, never lengths."""


@pytest.mark.heavy
@pytest.mark.parametrize(
    "block",
    [p for p in of_kind("yaml") if "train_path:" in p.values[0].text and not p.values[0].marker],
)
def test_yaml_block_with_its_data_trains(block, tmp_path):
    """A YAML block with its data file on the page trains as `jgrpo train --config` runs it."""
    folder = page_folder(tmp_path, block.page)
    (folder / "snippet.yaml").write_text(block.text)
    jgrpo = Path(sys.executable).parent / "jgrpo"
    argv = [str(jgrpo), "train", "--config", "snippet.yaml", "--run-dir", "run", *TRAIN_SMALL]
    proc = subprocess.run(argv, cwd=folder, env=child_env(), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (folder / "run" / "final" / "config.json").is_file()


def test_the_environment_example_plays(tmp_path):
    """multi-turn.md's Game: the reset/step contract on a few replies."""
    folder = page_folder(tmp_path, "docs/multi-turn.md")
    code = (
        "from my_env import Game\n"
        "g = Game()\n"
        "assert g.reset(secret='3', prompt='p') == 'Guess my number (1-10).'\n"
        "assert g.step('I say 7') == ('Lower.', None, False)\n"
        "assert g.step('no idea') == ('Say a number.', None, False)\n"
        "assert g.step('1, then 2') == ('Higher.', None, False)\n"
        "assert g.step('It is 3') == (None, 1.0, True)\n"
    )
    run_python(code, folder, timeout=60)


# ---- bash blocks, in a fresh clone ----------------------------------------------------------


@pytest.fixture(scope="module")
def clone(tmp_path_factory) -> Path:
    """The checkout's tracked files as they are now (a fresh clone of the working tree): no
    .venv, no runs/, no caches."""
    out = tmp_path_factory.mktemp("clone") / "jgrpo"
    names = subprocess.run(
        ["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True
    ).stdout.split(b"\0")
    for name in filter(None, (n.decode() for n in names)):
        if (REPO / name).is_file():
            (out / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, out / name)
    return out


def cli_options() -> dict[str, set[str]]:
    """Each jgrpo subcommand's option strings."""
    from jgrpo.cli import _parser

    sub = next(a for a in _parser()._actions if a.choices and "train" in a.choices)
    return {
        name: {s for a in p._actions for s in a.option_strings} for name, p in sub.choices.items()
    }


def check_command(command: str, kind: str, folder: Path) -> str | None:
    """None when a not-run command is valid (see the module docstring), else what is wrong."""
    words = program(command)
    flags = [w.strip("[]").split("=", 1)[0] for w in words if w.strip("[").startswith("--")]
    if kind == "make":
        makefile = (folder / "Makefile").read_text()
        missing = [t for t in words[1:] if not re.search(rf"^{re.escape(t)}:", makefile, re.M)]
        return f"no make target {missing}" if missing else None
    if kind == "tool":
        script = folder / words[1]
        if not script.is_file():
            return f"{words[1]} does not exist"
        source = script.read_text()
        missing = [f for f in flags if f"'{f}'" not in source and f'"{f}"' not in source]
        if missing:  # flags built in a loop (warm_start.py's settings): ask the script itself
            usage = subprocess.run(
                [sys.executable, str(script), "--help"], capture_output=True, text=True, cwd=folder
            ).stdout
            missing = [f for f in missing if not re.search(rf"{re.escape(f)}\b", usage)]
        return f"{words[1]} takes no {missing}" if missing else None
    options = cli_options()
    if len(words) < 2 or words[1] not in options:
        return f"jgrpo has no subcommand {words[1:2]}"
    missing = [f for f in flags if f not in options[words[1]]]
    return f"jgrpo {words[1]} takes no {missing}" if missing else None


def run_command(command: str, folder: Path) -> None:
    proc = subprocess.run(
        program(command),
        cwd=folder,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
    )
    assert proc.returncode == 0, f"{command}\n{proc.stderr[-3000:]}"


def jgrpo_on_path(monkeypatch) -> None:
    """`jgrpo` as the user's shell finds it after `source .venv/bin/activate`."""
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")


@pytest.mark.parametrize("block", of_kind("bash", "bash-run"))
def test_bash_block_commands_exist_and_cheap_ones_run(block, clone, monkeypatch):
    jgrpo_on_path(monkeypatch)
    problems = []
    for command in commands(block.text):
        kind = command_kind(block, command)
        if kind == "show-config":
            run_command(command, clone)
        elif kind != "run":
            problem = check_command(command, kind, clone)
            problems += [f"{command}: {problem}"] if problem else []
    assert not problems, "\n".join(problems)


@pytest.mark.heavy
@pytest.mark.parametrize("block", of_kind("bash-run"))
def test_bash_block_runs_as_printed(block, clone, monkeypatch):
    """Training, evaluation, inspect-step and plot commands, in order, in the fresh clone."""
    jgrpo_on_path(monkeypatch)
    for command in commands(block.text):
        if command_kind(block, command) == "run":
            run_command(command, clone)


def test_the_walkthrough_reads_markers_and_commands(tmp_path):
    """The extraction itself, on a page written here."""
    page = tmp_path / "probe.md"
    page.write_text(
        "<!-- not run: a job script -->\n```bash\nsrun x\n```\n\n"
        "<!-- file: data/a.jsonl -->\n```json\n{}\n```\n"
        "```python\n# m.py\nx = 1\n```\n"
        "```bash\nXLA_FLAGS=a jgrpo inspect-step --config FILE \\\n  --json  # c\n"
        "jgrpo plot runs/x\nmake demo\n```\n"
    )
    blocks = read_blocks(page, tmp_path)
    assert [(b.marker, b.note) for b in blocks[:2]] == [
        ("not run", "a job script"),
        ("file", "data/a.jsonl"),
    ]
    assert [block_kind(b) for b in blocks] == ["shown", "file", "module", "bash-run"]
    assert blocks[2].module == "m.py"
    assert commands(blocks[3].text) == [
        "XLA_FLAGS=a jgrpo inspect-step --config FILE    --json",
        "jgrpo plot runs/x",
        "make demo",
    ]
    assert [command_kind(blocks[3], c) for c in commands(blocks[3].text)] == [
        "synopsis",
        "run",
        "make",
    ]
