"""The compatibility key: every fact that can change a restored engine's results or memory.

``key_fields`` returns a flat dict of strings (stored in the manifest, shown by ``inspect``);
``key_digest`` is the SHA-256 of its canonical JSON. A snapshot is used only when all fields
match; ``diff_fields`` names the ones that differ.

The model files digest must be cheap (it runs on every boot, before we know whether to
restore), so large weight files are fingerprinted, not hashed in full: size, the Hugging Face
cache's blob name when the file is a symlink into ``blobs/`` (that name is the file's SHA-256),
else the first and last MiB (the safetensors header included) plus 64 KiB at 16 evenly spaced
offsets. Small files (config, tokenizer) are hashed in full. A weight file rewritten in place
with the same size and the same bytes at every sampled window would go unnoticed.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
from functools import cache
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING

import warmboot
from warmboot.host import host_cpu_features

if TYPE_CHECKING:  # NOTE: imported where used, so the launcher can digest models without it
    import torch

SMALL_FILE_BYTES = 16 << 20
EDGE_BYTES = 1 << 20
SAMPLE_BYTES = 64 << 10
NUM_SAMPLES = 16
DIGEST_CHARS = 32


def key_fields(model_dir: str | Path, settings: dict[str, object], device: torch.device) -> dict:
    """All key fields: the model files digest, engine ``settings``, software and device."""
    fields = {"model_files": model_files_digest(Path(model_dir))}
    fields.update({f"engine.{k}": str(v) for k, v in sorted(settings.items())})
    fields.update(software_fields())
    fields.update(device_fields(device))
    return fields


def key_digest(fields: dict[str, str]) -> str:
    blob = json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:DIGEST_CHARS]


def diff_fields(want: dict[str, str], have: dict[str, str]) -> list[str]:
    """``name: want != have`` for every field that differs (missing fields count)."""
    out = []
    for name in sorted(set(want) | set(have)):
        a, b = want.get(name, "<absent>"), have.get(name, "<absent>")
        if a != b:
            out.append(f"{name}: {_short(a)} (this engine) != {_short(b)} (snapshot)")
    return out


def _short(value: str, limit: int = 60) -> str:
    return value if len(value) <= limit else value[: limit - 3] + "..."


def model_files_digest(model_dir: Path) -> str:
    h = hashlib.sha256()
    for path in sorted(p for p in model_dir.rglob("*") if p.is_file()):
        rel = path.relative_to(model_dir).as_posix()
        if any(part.startswith(".") for part in rel.split("/")):
            continue
        h.update(f"{rel}\0{_file_fingerprint(path)}\n".encode())
    return h.hexdigest()


def _file_fingerprint(path: Path) -> str:
    size = path.stat().st_size
    if size <= SMALL_FILE_BYTES:
        return f"{size}:sha256:{hashlib.sha256(path.read_bytes()).hexdigest()}"
    blob = os.path.realpath(path)
    if os.path.basename(os.path.dirname(blob)) == "blobs" and len(os.path.basename(blob)) == 64:
        return f"{size}:hfblob:{os.path.basename(blob)}"
    h = hashlib.sha256()
    with open(path, "rb") as f:
        h.update(f.read(EDGE_BYTES))
        for i in range(1, NUM_SAMPLES + 1):
            f.seek(size * i // (NUM_SAMPLES + 2))
            h.update(f.read(SAMPLE_BYTES))
        f.seek(size - EDGE_BYTES)
        h.update(f.read(EDGE_BYTES))
    return f"{size}:sampled:{h.hexdigest()}"


@cache
def source_digest() -> str:
    """Digest of warmboot's own source files: a development build that changes the code
    changes the key even though the version string stays the same."""
    root = Path(warmboot.__file__).parent
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:DIGEST_CHARS]


@cache
def software_fields() -> dict[str, str]:
    import torch

    return {
        "warmboot": warmboot.__version__,
        "warmboot_source": source_digest(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": _version("triton"),
        "cuda": str(torch.version.cuda),
    }


def device_fields(device: torch.device) -> dict[str, str]:
    if device.type == "cuda":
        import torch

        props = torch.cuda.get_device_properties(device)
        return {
            "device.type": "cuda",
            "device.name": props.name,
            "device.capability": f"{props.major}.{props.minor}",
            "device.driver": _nvidia_driver(),
        }
    model, _, flags = host_cpu_features().partition(" | ")
    return {
        "device.type": device.type,
        "device.name": model,
        "device.cpu_flags": flags,
        "device.driver": "none",
    }


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "absent"


def _nvidia_driver() -> str:
    try:
        first = Path("/proc/driver/nvidia/version").read_text().splitlines()[0]
    except (OSError, IndexError):
        return "unknown"
    return " ".join(first.split()[:8])
