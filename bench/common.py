"""What the benchmark scripts share: the machine's description and the plotting backend."""

from __future__ import annotations

import contextlib
import datetime
import os
import platform
import subprocess
import tempfile
from pathlib import Path


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def report_meta(**extra) -> dict:
    """Today's date and the machine (CPU model, cores), then ``extra``."""
    today = datetime.date.today().isoformat()
    return {"date": today, "machine": f"{cpu_name()}, {os.cpu_count()} cores"} | extra


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_report(out: Path, name: str, meta: dict, rows: list, lines: list[str], fig) -> None:
    """``out/name.{json,md,png}``: the raw rows with ``meta``, the table text, the figure."""
    import json

    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(meta | {"rows": rows}, indent=2))
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")
    fig.tight_layout()
    fig.savefig(out / f"{name}.png", dpi=120)
    print("\n".join(lines))


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
