"""The benchmarks' layout, checked on the source and the pages (no benchmark runs): no import
cycle among the bench modules, the formatter lays out all of bench/, no dated copies in
docs/benchmarks, and every page there names the tree (or the commit) that made it."""

from __future__ import annotations

import ast
import graphlib
import re
from pathlib import Path

import pytest

from bench.common import page_lines

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
PAGES = ROOT / "docs" / "benchmarks"
MAX_FILE_LINES = 400
DATED = re.compile(r"_\d{4}-\d{2}-\d{2}")
"""A dated copy's name: ``decode_2026-12-03d.json``."""
NAMES_TREE = re.compile(r"\b(?:tree|committed in) [0-9a-f]{7,40}\b")
TOP_LINES = 6
"""A page names its tree this near the top (under its title)."""


def _dotted(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def _modules() -> dict[str, Path]:
    """bench's modules by dotted name (a package by its own)."""
    return {_dotted(path): path for path in BENCH.rglob("*.py")}


def _owner(name: str, mods: dict[str, Path]) -> str | None:
    """The bench module ``name`` (a module, or a name in one) lives in."""
    while name not in mods and "." in name:
        name = name.rpartition(".")[0]
    return name if name in mods else None


def _imports(path: Path, mods: dict[str, Path]) -> set[str]:
    """Every bench module ``path`` imports anywhere (module level or inside functions)."""
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names += [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
    return {m for n in names if n.split(".")[0] == "bench" and (m := _owner(n, mods))}


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    graph = {m: _imports(p, mods) - {m} for m, p in mods.items()}
    # NOTE: ``from bench import x`` names the package too; a package imports no submodule here
    return {m: {d for d in deps if not m.startswith(d + ".")} for m, deps in graph.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as e:
        return list(reversed(e.args[1]))
    return None


def _format_exemptions(text: str) -> list[int]:
    """Lines that keep the formatter out: ``# fmt: skip`` / ``# fmt: off``."""
    marker = re.compile(r"#\s*fmt:\s*(skip|off)\b")
    return [i for i, line in enumerate(text.splitlines(), 1) if marker.search(line)]


def _dated(paths: list[Path]) -> list[str]:
    return [p.name for p in paths if DATED.search(p.name)]


def _names_tree(page: str) -> bool:
    return bool(NAMES_TREE.search("\n".join(page.splitlines()[:TOP_LINES])))


def _pages() -> list[Path]:
    return sorted(p for p in PAGES.rglob("*.md") if p.name != "README.md")


# --- the checks ---------------------------------------------------------------------------


def test_no_import_cycle_among_the_bench_modules():
    graph = _graph()
    assert "bench.common" in graph and "bench.peers.vllm_cpu" in graph
    assert _cycle(graph) is None, f"import cycle: {' -> '.join(_cycle(graph))}"


def test_coldstart_and_process_start_share_the_model_builders():
    """``coldstart --process`` hands over to ``process_start``; the models both start come
    from ``bench.checkpoints``, not from each other."""
    graph = _graph()
    assert "bench.coldstart" not in graph["bench.process_start"]
    assert "bench.checkpoints" in graph["bench.coldstart"] & graph["bench.process_start"]


@pytest.mark.parametrize("path", sorted(BENCH.rglob("*.py")), ids=lambda p: p.name)
def test_the_formatter_lays_out_every_bench_file(path):
    assert _format_exemptions(path.read_text()) == [], f"{path.name}: # fmt: skip / off"


@pytest.mark.parametrize("path", sorted(BENCH.rglob("*.py")), ids=lambda p: p.name)
def test_bench_files_are_short(path):
    lines = path.read_text().count("\n")
    assert lines <= MAX_FILE_LINES, f"{path.name} has {lines} lines (at most {MAX_FILE_LINES})"


def test_no_dated_copies_in_docs_benchmarks():
    assert _dated(sorted(PAGES.rglob("*"))) == []


@pytest.mark.parametrize("page", _pages(), ids=lambda p: str(p.relative_to(PAGES)))
def test_every_page_names_its_tree(page):
    assert _names_tree(page.read_text()), f"{page.name}: no 'tree <hash>' / 'committed in <hash>'"


# --- each check fails when the rule is broken -----------------------------------------------


def test_the_cycle_check_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) in (
        ["a", "b", "c", "a"],
        ["b", "c", "a", "b"],
        ["c", "a", "b", "c"],
    )
    assert _cycle({"a": {"b"}, "b": set()}) is None
    graph = _graph()  # NOTE: the circle this file guards against, put back
    graph["bench.process_start"] = graph["bench.process_start"] | {"bench.coldstart"}
    graph["bench.coldstart"] = graph["bench.coldstart"] | {"bench.process_start"}
    assert _cycle(graph) is not None


def test_the_import_reader_sees_imports_inside_functions(tmp_path):
    mods = {"bench.a": tmp_path / "a.py", "bench.b": tmp_path / "b.py", "bench": tmp_path}
    mods["bench.a"].write_text("def f():\n    from bench import b\n    import bench.b as c\n")
    assert _imports(mods["bench.a"], mods) == {"bench", "bench.b"}


def test_the_format_check_finds_an_exemption():
    assert _format_exemptions("x = [\n    1, 2,\n]  # fmt: skip\n") == [3]
    assert _format_exemptions("# fmt: off\nx = 1\n# fmt: on\n") == [1]
    assert _format_exemptions("x = 1  # formatted\n") == []


def test_the_dated_check_finds_a_dated_copy():
    names = [Path("decode.json"), Path("decode_2026-12-03d.json"), Path("kernels_2026-12-06.md")]
    assert _dated(names) == ["decode_2026-12-03d.json", "kernels_2026-12-06.md"]
    assert _dated([Path("soak_defaults.json"), Path("decode.png")]) == []


def test_a_written_page_names_its_tree_and_one_without_fails():
    meta = {"date": "2026-12-08", "machine": "a CPU, 2 cores", "commit": "6e47a9b", "dirty": True}
    page = "\n".join(page_lines(["# A benchmark", "", "the table"], meta))
    assert _names_tree(page)
    assert "Run on 2026-12-08, a CPU, 2 cores, tree 6e47a9b with uncommitted changes." in page
    unknown = "\n".join(page_lines(["# A benchmark", "", "the table"], meta | {"commit": None}))
    assert not _names_tree(unknown)
    assert not _names_tree("# A benchmark\n\n2026-12-08, a CPU.\n")
    assert _names_tree("# A\n\nRaw numbers (`a.json`) committed in 0e36f23; the run's tree ...")
    late = "# A\n" + "\n" * TOP_LINES + "tree 0e36f23\n"
    assert not _names_tree(late)
