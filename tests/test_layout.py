"""House rules that code can check: documented config fields, one-way heavy imports."""

import ast
import dataclasses
import pkgutil
import subprocess
import sys
from pathlib import Path

from jgrpo import config


def sections(cls=config.Config, seen=None):
    seen = set() if seen is None else seen
    seen.add(cls)
    for f in dataclasses.fields(cls):
        default = f.default if f.default is not dataclasses.MISSING else None
        if dataclasses.is_dataclass(default) and type(default) not in seen:
            sections(type(default), seen)
    return seen


def test_every_config_field_has_a_one_line_doc():
    found = sections() | {config.RewardFunctionConfig}
    assert config.LossConfig in found and config.AdvantageConfig in found
    for cls in found:
        docs = config.field_docs(cls)
        for f in dataclasses.fields(cls):
            assert docs.get(f.name), f"{cls.__name__}.{f.name} has no doc"
            assert "\n" not in docs[f.name], f"{cls.__name__}.{f.name}: doc is not one line"


def test_trainer_imports_neither_ray_nor_torch():
    code = (
        "import sys, jgrpo.train, jgrpo.cli, jgrpo.export, jgrpo.inspect_step; "
        "print(sorted(m for m in ('ray', 'torch') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_config_module_is_cheap():
    """The CLI validates configs before anything heavy: jgrpo.config imports no jax."""
    code = "import sys, jgrpo.config; print('jax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


CONFIG_MODULES = sorted(f"jgrpo.config.{m.name}" for m in pkgutil.iter_modules(config.__path__))


def test_every_config_module_imports_without_jax():
    """Each part of jgrpo.config, imported on its own in a fresh process, pulls in no jax."""
    assert {"jgrpo.config.sections", "jgrpo.config.loading", "jgrpo.config.rules"} <= set(
        CONFIG_MODULES
    )
    for name in CONFIG_MODULES:
        code = f"import sys, {name}; print('jax' in sys.modules)"
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True
        )
        assert out.stdout.strip() == "False", f"{name} imports jax"


MAX_CONFIG_FUNCTION_LINES = 80


def test_config_rules_are_small_functions():
    """validate() is split per section: no function in jgrpo/config/ runs past 80 lines."""
    long = []
    for path in sorted(Path(config.__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_CONFIG_FUNCTION_LINES:
                    long.append(f"{path.name}:{node.name} ({lines} lines)")
    assert not long, f"functions over {MAX_CONFIG_FUNCTION_LINES} lines: {long}"


CONFIG_LAYERS = ("sections", "rules", "loading", "resume")
"""jgrpo.config's parts, lowest first: each imports only parts before it (no circles)."""


def test_config_modules_import_one_way():
    folder = Path(config.__file__).parent
    assert sorted(p.stem for p in folder.glob("*.py")) == sorted((*CONFIG_LAYERS, "__init__"))
    for i, name in enumerate(CONFIG_LAYERS):
        tree = ast.parse((folder / f"{name}.py").read_text())
        used = {
            node.module.removeprefix("jgrpo.config.")
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jgrpo.config")
        }
        later = used - set(CONFIG_LAYERS[:i])
        assert not later, f"jgrpo/config/{name}.py imports {sorted(later)}, not below it"
