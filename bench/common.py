"""What the benchmark scripts share: where the pages go, the machine and the tree a run was made
on, the report's files (raw JSON, the page, the plot), child processes and older trees.

Stdlib only at import: sandboxed children import their script, and through it this module.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "benchmarks"
"""Where each benchmark's page (``.md``), raw numbers (``.json``) and plot (``.png``) go: the
latest run only; earlier runs are in git history."""


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> str:
    """The CPU model, this process's torch threads and torch version."""
    import torch

    return f"{cpu_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}"


def git(*cmd: str, root: Path = ROOT) -> str | None:
    """``git -C root *cmd``'s output, or None where git is missing or fails."""
    try:
        out = subprocess.run(["git", "-C", str(root), *cmd], capture_output=True, text=True)
    except OSError:
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def git_tree(root: Path = ROOT) -> dict:
    """The commit checked out (short hash) and whether tracked files differ from it."""
    commit = git("rev-parse", "--short", "HEAD", root=root)
    status = git("status", "--porcelain", "--untracked-files=no", root=root)
    return {"commit": commit, "dirty": None if status is None else bool(status)}


def committed_in(path: Path) -> str | None:
    """The commit (short hash) that last wrote ``path``, or None if git has none."""
    return git("log", "--format=%h", "-1", "--", str(path)) or None


def report_meta(**extra) -> dict:
    """Today's date, the machine (CPU model, cores) and the tree (``git_tree``), then
    ``extra`` (which may name its own ``machine``)."""
    today = datetime.date.today().isoformat()
    base = {"date": today, "machine": f"{cpu_name()}, {os.cpu_count()} cores"}
    return base | git_tree() | extra


def run_line(meta: dict) -> str:
    """The page's statement of what made it: Run on <date>, <machine>, tree <commit>."""
    commit = meta.get("commit")
    tree = f"tree {commit}" if commit else "tree not recorded"
    if commit and meta.get("dirty"):
        tree += " with uncommitted changes"
    return f"Run on {meta.get('date', '?')}, {meta.get('machine', '?')}, {tree}."


def page_lines(lines: list[str], meta: dict) -> list[str]:
    """``lines`` (a page whose first line is its title) with ``run_line`` under the title."""
    return [*lines[:1], "", run_line(meta), *lines[1:]]


def write_page(path: Path, lines: list[str], meta: dict, end: str = "\n") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(page_lines(lines, meta)) + end)


def write_json(path: Path, doc, indent: int = 2) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=indent))


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: Path, dpi: int = 120) -> None:
    """Lay ``fig`` out, write it to ``path`` and free it."""
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)


def save_report(out: Path, name: str, meta: dict, rows, lines: list[str], fig) -> None:
    """``out/name.{json,md,png}``: the raw rows with ``meta``, the page, the figure."""
    write_json(out / f"{name}.json", meta | {"rows": rows})
    write_page(out / f"{name}.md", lines, meta)
    save_figure(fig, out / f"{name}.png")
    print("\n".join(lines))


def md_table(head: list[str], align: str, rows: list[list] | None = None) -> list[str]:
    """A markdown table's lines: the header, the alignment row (one letter a column: ``l``
    ``---``, ``L`` ``:---``, ``r`` ``---:``, ``c`` ``:---:``), then ``rows``' cells."""
    marks = {"l": "---", "L": ":---", "r": "---:", "c": ":---:"}
    assert len(align) == len(head), (head, align)
    lines = ["| " + " | ".join(head) + " |", "| " + " | ".join(marks[a] for a in align) + " |"]
    return lines + ["| " + " | ".join(str(c) for c in r) + " |" for r in rows or []]


def child_json(args: list[str], tree: Path = ROOT, **env: str):
    """Run ``python *args`` with ``tree`` first on the path (cwd ``tree``, ``env`` added);
    the JSON of its last line of output. Raises ``RuntimeError`` (with the end of its stderr)
    if it fails."""
    full = dict(os.environ, PYTHONPATH=str(tree), **env)
    out = subprocess.run(
        [sys.executable, *args], env=full, cwd=tree, capture_output=True, text=True
    )
    if out.returncode:
        raise RuntimeError(f"child {args} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def drop_caches() -> bool:
    """Empty the page cache (root only); whether it could."""
    try:
        subprocess.run(["sync"], check=True)
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except (OSError, subprocess.CalledProcessError):
        return False


@contextlib.contextmanager
def revision_trees(root: Path, revs: list[str]):
    """``{rev: tree}`` for older revisions, each checked out in a temporary git worktree
    (removed afterwards), then ``"current": root``."""
    git = ["git", "-C", str(root)]
    trees: dict[str, Path] = {}
    try:
        for rev in revs:
            trees[rev] = Path(tempfile.mkdtemp(prefix="wb-rev-")) / "tree"
            cmd = [*git, "worktree", "add", "--detach", str(trees[rev]), rev]
            subprocess.run(cmd, check=True, capture_output=True)
        yield trees | {"current": root}
    finally:
        for tree in trees.values():
            subprocess.run([*git, "worktree", "remove", "--force", str(tree)], check=False)
