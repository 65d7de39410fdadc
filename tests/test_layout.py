"""The layout's rules, checked on the source: the torch-free core, no import cycles, short
functions and files outside the kernels."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "warmboot"
MAX_FUNCTION_LINES = 60
MAX_FILE_LINES = 400


def _modules() -> dict[str, Path]:
    mods = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        mods[name.removesuffix(".__init__")] = path
    return mods


def _imports(path: Path, mods: dict[str, Path]) -> set[str]:
    """Every warmboot module ``path`` imports anywhere: module level, under TYPE_CHECKING,
    inside functions."""

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
        else:
            continue
        found |= {r for n in names if n.startswith("warmboot") and (r := resolve(n))}
    return found


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle, or None (depth-first search with colours)."""
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for dep in sorted(graph[m]):
            if state.get(dep) == 1:
                return path[path.index(dep) :] + [dep]
            if dep not in state and (found := visit(dep)):
                return found
        state[m] = 2
        path.pop()
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_no_import_cycles():
    mods = _modules()
    graph = {m: _imports(p, mods) - {m} for m, p in mods.items()}
    # NOTE: a package imports its own submodules to re-export them; that is not a cycle
    graph = {m: {d for d in deps if not d.startswith(m + ".")} for m, deps in graph.items()}
    assert _cycle(graph) is None, f"import cycle: {' -> '.join(_cycle(graph))}"


def test_the_cycle_check_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_core_imports_nothing_but_the_top_level_and_itself():
    """``warmboot.core`` is a leaf: besides itself it may use only the torch-free top-level
    modules (configs, sampling params, outputs, the tokenizer)."""
    allowed = {"warmboot.config", "warmboot.sampling_params", "warmboot.outputs"}
    mods = _modules()
    for name, path in mods.items():
        if name.startswith("warmboot.core"):
            bad = {
                d
                for d in _imports(path, mods)
                if not d.startswith(("warmboot.core", "warmboot.tokenizer")) and d not in allowed
            }
            assert not bad, f"{name} imports {sorted(bad)}"


BLOCK_TORCH = """
import importlib, pkgutil, sys
class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError(f"torch is unimportable in this test ({name})")
sys.meta_path.insert(0, NoTorch())
import warmboot.core
names = [m.name for m in pkgutil.walk_packages(warmboot.core.__path__, "warmboot.core.")]
for name in names:
    importlib.import_module(name)
assert "torch" not in sys.modules
print(len(names))
"""


def test_core_imports_without_torch():
    out = subprocess.run(
        [sys.executable, "-c", BLOCK_TORCH], capture_output=True, text=True, cwd=ROOT
    )
    assert out.returncode == 0, out.stderr
    expected = len([p for p in (PACKAGE / "core").glob("*.py") if p.name != "__init__.py"])
    assert int(out.stdout.split()[-1]) == expected


def _outside_kernels() -> list[Path]:
    return [p for p in sorted(PACKAGE.rglob("*.py")) if "kernels" not in p.parts]


@pytest.mark.parametrize("path", _outside_kernels(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_short_functions_and_files(path):
    lines = path.read_text().count("\n")
    assert lines <= MAX_FILE_LINES, f"{path.name} has {lines} lines (at most {MAX_FILE_LINES})"
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            n = node.end_lineno - node.lineno + 1
            assert n <= MAX_FUNCTION_LINES, f"{path.name}:{node.lineno} {node.name} has {n} lines"


PRIVATE_OWNERS = ("runner", "scheduler", "sched", "block_manager", "bm", "kv")


def test_tests_touch_no_private_state_of_the_core_parts():
    """Tests use the runner's, scheduler's and block manager's public API (and their
    ``check_invariants``), so a change inside them breaks no test that should not break."""
    bad = []
    for path in sorted((ROOT / "tests").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Attribute) and node.attr.startswith("_")):
                continue
            if node.attr.startswith("__"):
                continue
            owner = node.value
            name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", "")
            if name in PRIVATE_OWNERS:
                bad.append(f"{path.name}:{node.lineno} {name}.{node.attr}")
    assert not bad, bad


RANKS = {
    # the layers bottom to top (docs: ARCHITECTURE.md): a module may import its own layer's
    # and lower layers' modules only
    **dict.fromkeys(
        (
            "warmboot",
            "architectures",
            "cache_files",
            "config",
            "engine_options",
            "host",
            "lora_request",
            "options",
            "outputs",
            "sampling_params",
            "tokenizer",
        ),
        0,
    ),
    "core": 1,
    "kernels": 2,
    "models": 3,
    "lora": 3,
    "device": 4,
    "snapshot": 5,
    "engine": 6,
    "launcher": 7,
    "server": 8,
    "fleet": 9,
    "cli": 10,
}


def _layer(module: str) -> int:
    parts = module.split(".")
    return RANKS[parts[1] if len(parts) > 1 else parts[0]]


def _upward(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    return {(m, d) for m, deps in graph.items() for d in deps if _layer(d) > _layer(m)}


def test_no_module_imports_a_layer_above_its_own():
    """An import from a higher layer (a kernel knowing a model layer, the config knowing the
    models) fails here."""
    mods = _modules()
    assert {m.split(".")[1] for m in mods if "." in m} <= RANKS.keys(), "a package without a rank"
    graph = {m: _imports(p, mods) - {m} for m, p in mods.items()}
    assert _upward(graph) == set()


def test_the_layer_check_finds_an_upward_import():
    graph = {
        "warmboot.kernels.a": {"warmboot.models.b"},
        "warmboot.models.b": {"warmboot.kernels.a"},
    }
    assert _upward(graph) == {("warmboot.kernels.a", "warmboot.models.b")}
