"""House rules that code can check: documented config fields, one-way heavy imports, the
documentation (a short README linking every docs/ page, links that resolve, short module
docstrings), an import graph of jgrpo/ without cycles, one model loader, the make test /
make test-all split (the `heavy` marker)."""

import ast
import dataclasses
import pkgutil
import re
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


def test_model_path_checks_are_cheap():
    """model.path is checked before any model work: the lazy jgrpo.models package, the path
    resolution, the tiny model's builders and the file writers import no jax."""
    code = (
        "import sys, jgrpo.models, jgrpo.models.sources, jgrpo.models.tiny, jgrpo.files; "
        "print('jax' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# ------------------------------------------------------------------ documentation

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 200
DOCSTRING_MAX_LINES = 15
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def doc_pages():
    return sorted((ROOT / "docs").glob("*.md"))


def heading_anchors(text):
    """GitHub's anchors of a Markdown file's headings (lowercase, punctuation dropped)."""
    anchors = set()
    for line in text.splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            anchors.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return anchors


def local_links(path):
    """(target path, anchor) of every relative link in a Markdown file (code blocks skipped)."""
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        yield (path.parent / file).resolve() if file else path.resolve(), anchor


def test_readme_is_short_and_links_every_doc_page():
    readme = ROOT / "README.md"
    assert len(readme.read_text().splitlines()) <= README_MAX_LINES
    linked = {target for target, _ in local_links(readme)}
    pages = doc_pages()
    assert pages and (ROOT / "docs" / "index.md") in pages
    for page in pages:
        assert page.resolve() in linked, f"{page.relative_to(ROOT)} is not linked from README.md"


def test_doc_links_resolve_inside_the_repository():
    for path in [ROOT / "README.md", *doc_pages()]:
        for target, anchor in local_links(path):
            where = f"{path.relative_to(ROOT)} -> {target}#{anchor}"
            assert target.is_relative_to(ROOT), f"{where}: outside the repository"
            assert target.exists(), f"{where}: no such file"
            if anchor:
                assert anchor in heading_anchors(target.read_text()), f"{where}: no such heading"


def test_module_docstrings_are_short():
    for path in sorted((ROOT / "jgrpo").rglob("*.py")):
        name = path.relative_to(ROOT).as_posix()
        doc = ast.get_docstring(ast.parse(path.read_text()))
        assert doc, f"{name} has no module docstring"
        n = len(doc.splitlines())
        assert n <= DOCSTRING_MAX_LINES, f"{name}: module docstring of {n} lines"


TIMING = re.compile(
    r"\d(\.\d+)? ?(ms|us)\b|\d(\.\d+)? ?(GFLOP/s|tok/s|s/step|s a step|GB|MB)\b"
    r"|\d(\.\d+)?x (faster|slower|cheaper|the memory)|\d% (faster|slower|of a)"
    r"|~\d+(\.\d+)? ?(%|s|min|GB|MB)(\W|$)"
)
"""What a measured number looks like in a comment or docstring (timings, speedups, sizes)."""


def test_no_measured_timings_in_code_or_configs():
    """Measurements live in docs/performance.md only (with the command and the date)."""
    files = [*(ROOT / "jgrpo").rglob("*.py"), *(ROOT / "tools").glob("*.py")]
    files += (ROOT / "configs").glob("*.yaml")
    for path in sorted(files):
        name = path.relative_to(ROOT).as_posix()
        for n, line in enumerate(path.read_text().splitlines(), 1):
            assert not TIMING.search(line), f"{name}:{n}: a measured number: {line.strip()}"


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


CONFIG_LAYERS = ("model_sections", "sections", "bounds", "rules", "loading", "resume")
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


# ------------------------------------------------------------------ imports


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


# ------------------------------------------------------------------ make test / test-all


def test_make_test_leaves_the_heavy_proofs_to_make_test_all():
    """`make test` deselects the `heavy` marker, `make test-all` runs everything, CI runs
    test-all; every marker a test uses is registered in pyproject.toml."""
    import tomllib

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


FILE_MAX_LINES = 600


def test_no_module_is_over_600_lines():
    """One file, one job: a module that outgrows this has a second job to move out."""
    for path in sorted((ROOT / "jgrpo").rglob("*.py")):
        n = len(path.read_text().splitlines())
        assert n <= FILE_MAX_LINES, f"{path.relative_to(ROOT)}: {n} lines"
