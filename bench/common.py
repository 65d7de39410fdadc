"""What the benchmark scripts share: the machine's description and the plotting backend."""

from __future__ import annotations

import datetime
import os
import platform
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
