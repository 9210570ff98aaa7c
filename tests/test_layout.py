"""House rules that code can check: documented config fields, one-way heavy imports, the
make test / make test-all split (the `heavy` marker)."""

import dataclasses
import subprocess
import sys

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
    """The CLI validates configs before anything heavy: config.py imports no jax."""
    code = "import sys, jgrpo.config; print('jax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_make_test_leaves_the_heavy_proofs_to_make_test_all():
    """`make test` deselects the `heavy` marker, `make test-all` runs everything, CI runs
    test-all; every marker a test uses is registered in pyproject.toml."""
    import re
    import tomllib
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    makefile = (root / "Makefile").read_text()

    def recipe(target):
        found = re.search(rf"^{target}:.*\n((?:\t.*\n)+)", makefile, re.M)
        assert found, f"Makefile has no `{target}` target"
        return found.group(1)

    assert '-m "not heavy"' in recipe("test") and "pytest" in recipe("test")
    assert "pytest" in recipe("test-all") and '-m "' not in recipe("test-all")
    assert "not heavy" in recipe("test-fast")
    assert "make test-all" in (root / ".ci" / "run").read_text()
    ini = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    registered = {m.split(":")[0] for m in ini["markers"]}
    assert {"slow", "heavy"} <= registered
    builtin = {"parametrize", "skipif", "skip", "xfail", "usefixtures", "filterwarnings"}
    for path in (root / "tests").glob("*.py"):
        used = set(re.findall(r"pytest\.mark\.(\w+)", path.read_text())) - builtin
        assert used <= registered, f"{path.name}: unregistered markers {used - registered}"
