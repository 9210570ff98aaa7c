"""House rules that code can check: documented config fields, one-way heavy imports, an
import graph without cycles, one model loader."""

import ast
import dataclasses
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
    """The CLI validates configs before anything heavy: config.py imports no jax."""
    code = "import sys, jgrpo.config; print('jax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_model_path_checks_are_cheap():
    """model.path is checked before any model work: the lazy jgrpo.models package, the path
    resolution, the tiny model's builders and the file writers import no jax."""
    code = (
        "import sys, jgrpo.models, jgrpo.models.sources, jgrpo.models.tiny, jgrpo.files; "
        "print('jax' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


ROOT = Path(__file__).resolve().parents[1]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _lazy_exports(file: Path, package: str) -> dict[str, str]:
    """{name: module} of a package's PEP 562 `_EXPORTS` table (names imported on access)."""
    for node in ast.parse(file.read_text()).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "_EXPORTS" for t in node.targets
        ):
            table = ast.literal_eval(node.value)
            return {k: v if v.startswith("jgrpo") else f"{package}.{v}" for k, v in table.items()}
    return {}


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """{module: jgrpo modules it imports} over jgrpo/, every import statement counted (module
    level or inside a function); `from pkg import name` goes to the submodule pkg.name, or to
    the module a lazy package's `_EXPORTS` names for it, else to pkg itself."""
    files = {_module_name(p): p for p in (root / "jgrpo").rglob("*.py")}
    packages = {_module_name(p) for p in (root / "jgrpo").rglob("__init__.py")}
    lazy = {pkg: _lazy_exports(files[pkg], pkg) for pkg in packages}
    graph = {}
    for name, file in files.items():
        here = name if name in packages else name.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                module = node.module or ""
                if node.level:
                    anchor = here.split(".")[: len(here.split(".")) - node.level + 1]
                    module = ".".join([*anchor, module] if module else anchor)
                for alias in node.names:
                    sub = f"{module}.{alias.name}"
                    found.add(sub if sub in files else lazy.get(module, {}).get(alias.name, module))
        graph[name] = {m for m in found if m in files and m != name}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each back edge of a depth-first walk as the cycle it closes ([] = the graph is a DAG)."""
    state, cycles, stack = {}, [], []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == "open":
                cycles.append([*stack[stack.index(dep) :], dep])
            elif dep not in state:
                visit(dep)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return cycles


def test_import_graph_has_no_cycles():
    graph = import_graph()
    assert "jgrpo.checkpoint" in graph["jgrpo.train"]  # the walk sees the imports
    assert "jgrpo.models.hf" in graph["jgrpo.models.policy"]
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]
    cycles = import_cycles(graph)
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def _jgrpo_from_pretrained(file: Path) -> list[int]:
    """Lines of `file` that import or call jgrpo's `from_pretrained` (not transformers')."""
    lines = []
    for node in ast.walk(ast.parse(file.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jgrpo"):
            if any(alias.name == "from_pretrained" for alias in node.names):
                lines.append(node.lineno)
        elif isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Name) and func.id == "from_pretrained":
                lines.append(node.lineno)
            elif isinstance(func, ast.Attribute) and func.attr == "from_pretrained":
                owner = ast.unparse(func.value)
                if owner.startswith("jgrpo") or owner in ("models", "hf"):
                    lines.append(node.lineno)
    return lines


def test_one_model_loader():
    """Train, export, inspect-step and the tools build models with `jgrpo.models.load_policy`;
    `from_pretrained` (the low-level HF reader) is used only inside jgrpo/models/."""
    files = [*(ROOT / "jgrpo").rglob("*.py"), *(ROOT / "tools").glob("*.py")]
    assert _jgrpo_from_pretrained(ROOT / "tests" / "test_model.py")  # the check sees calls
    offenders = [
        f"{file.relative_to(ROOT)}:{line}"
        for file in files
        if (ROOT / "jgrpo" / "models") not in file.parents
        for line in _jgrpo_from_pretrained(file)
    ]
    assert not offenders, f"from_pretrained outside jgrpo/models/ (use load_policy): {offenders}"
