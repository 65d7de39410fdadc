"""Inductor's compile artifacts in a tier-A image, so a restored engine does not compile, and
the native kernels' library (``kernels.native``), so it builds nothing either.

The blob is inductor's cache directory (AOT-autograd and FX-graph entries, the generated
code and the C++ kernels built from it) or, when that directory is large (a shared one on a
developer's machine), ``torch.compiler.save_cache_artifacts``'s entries. A restore puts it
back into the local cache before its compile phase, whose trace then hits every entry.

That blob is code, serialised with pickle inside torch, so the store's word is not enough:
besides the chunk hash every image entry has, the blob carries an HMAC under a key this
host (or fleet) holds, ``$WARMBOOT_ARTIFACT_KEY`` or a 0600 key file made on first use
(``artifact.key`` in the cache root). A blob whose MAC does not verify under our key is
never loaded: the engine compiles instead and says why. The native library is code too and
carries a MAC the same way. Weights stay plain tensors, never
unpickled, whatever the key. A sandboxed (tier-P) worker signs with the key of its own
sandbox: the host's key is never handed into a process image.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import secrets
from pathlib import Path

from warmboot.config import cache_root
from warmboot.snapshot.restore import new_file_target, write_new_file

log = logging.getLogger("warmboot")
ARTIFACT_FILE = "compile/inductor.bin"
NATIVE_FILE = "compile/warmboot_native.so"
MAGIC = b"warmboot-inductor-cache-1\n"
MAX_CACHE_DIR_BYTES = 64 << 20
KEY_ENV = "WARMBOOT_ARTIFACT_KEY"


def signing_key() -> bytes:
    """The artifact MAC key: ``$WARMBOOT_ARTIFACT_KEY`` (share it across a fleet), else this
    host's key file, created with mode 0600 when missing."""
    env = os.environ.get(KEY_ENV)
    if env:
        return env.encode()
    path = cache_root() / "artifact.key"
    try:
        return bytes.fromhex(path.read_text().strip())
    except (OSError, ValueError):
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    return bytes.fromhex(Path(path).read_text().strip())


def mac(blob: bytes) -> str:
    return hmac.new(signing_key(), blob, hashlib.sha256).hexdigest()


def saved_artifacts() -> tuple[bytes, dict] | None:
    """(blob, facts for the manifest) of this process's compiles, or None if it had none or
    they cannot be signed (an image without them is still a good image).

    The blob is inductor's whole cache directory when that is small (a fresh replica's is
    about 1 MB: graph entries, generated code and the built kernels, so a restore runs no
    C compiler either), else ``save_cache_artifacts``'s entries (a restore then rebuilds the
    kernels from the cached code)."""
    try:
        packed = _pack_cache_dir() or _mega_cache()
        if packed is None:
            return None
        blob, facts = packed
        facts |= {"file": ARTIFACT_FILE, "hmac": mac(blob), "bytes": len(blob)}
    except Exception as e:  # noqa: BLE001 - publish the weights without the compile
        log.warning("compile artifacts left out of the snapshot: %s: %s", type(e).__name__, e)
        return None
    return blob, facts


def load_artifacts(blob: bytes, facts: object) -> str:
    """Load a verified blob into inductor's caches; returns what happened, in words."""
    if not isinstance(facts, dict) or not isinstance(facts.get("hmac"), str):
        return "the snapshot's compile artifacts record no MAC: not loaded"
    if not hmac.compare_digest(facts["hmac"], mac(blob)):
        return f"compile artifacts not signed with this host's key ({KEY_ENV}): not loaded"
    if facts.get("kind") == "cache_dir":
        written = _unpack_cache_dir(blob, inductor_cache_dir())
        return f"compile artifacts loaded ({len(blob)} bytes, {written} cache files written)"
    import torch

    info = torch.compiler.load_cache_artifacts(blob)
    counts = {kind: len(keys) for kind, keys in info.artifacts.items()} if info else {}
    return f"compile artifacts loaded ({len(blob)} bytes, {counts})"


def saved_native() -> tuple[bytes, dict] | None:
    """(library, facts) of the native kernels this process loaded, or None."""
    from warmboot.kernels import native

    try:
        carried = native.carried()
        if carried is None:
            return None
        blob, keys = carried
        return blob, keys | {"file": NATIVE_FILE, "hmac": mac(blob), "bytes": len(blob)}
    except Exception as e:  # noqa: BLE001 - an image without it builds the library again
        log.warning("native library left out of the snapshot: %s: %s", type(e).__name__, e)
        return None


def load_native(blob: bytes, facts: object) -> str:
    """Place a verified native library into the cache; returns what happened, in words."""
    from warmboot.kernels import native

    if not isinstance(facts, dict) or not isinstance(facts.get("hmac"), str):
        return "the snapshot's native library records no MAC: not used"
    if not hmac.compare_digest(facts["hmac"], mac(blob)):
        return f"native library not signed with this host's key ({KEY_ENV}): not used"
    return native.adopt(blob, facts)


def inductor_cache_dir() -> Path:
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir())


def _mega_cache() -> tuple[bytes, dict] | None:
    import torch

    saved = torch.compiler.save_cache_artifacts()
    if saved is None or not saved[0]:
        return None
    blob, info = saved
    return blob, {"kind": "mega_cache", "entries": {k: len(v) for k, v in info.artifacts.items()}}


def _pack_cache_dir() -> tuple[bytes, dict] | None:
    """The cache directory's regular files as one blob: a magic line, the JSON index's length
    (8 bytes), the index (relative path and size per file), the contents. None if too big."""
    root = inductor_cache_dir()
    files = sorted(p for p in root.rglob("*") if p.is_file() and not p.is_symlink())
    files = [p for p in files if "locks" not in p.relative_to(root).parts]
    if not files or sum(p.stat().st_size for p in files) > MAX_CACHE_DIR_BYTES:
        return None
    datas = [p.read_bytes() for p in files]
    index = [
        {"path": p.relative_to(root).as_posix(), "size": len(d)}
        for p, d in zip(files, datas, strict=True)
    ]
    head = json.dumps(index).encode()
    blob = b"".join([MAGIC, len(head).to_bytes(8, "little"), head, *datas])
    return blob, {"kind": "cache_dir", "files": len(files)}


def _unpack_cache_dir(blob: bytes, root: Path) -> int:
    """Write the blob's files under ``root`` (existing files kept); returns how many."""
    if not blob.startswith(MAGIC):
        raise ValueError("compile artifacts: not a cache-dir blob")
    n = int.from_bytes(blob[len(MAGIC) : len(MAGIC) + 8], "little")
    at = len(MAGIC) + 8
    index = json.loads(blob[at : at + n])
    at += n
    written = 0
    for entry in index:
        rel, size = str(entry["path"]), int(entry["size"])
        if size < 0:
            raise ValueError(f"compile artifacts: bad size for {rel[:80]!r}")
        data, at = blob[at : at + size], at + size
        target = new_file_target(root, rel, f"{ARTIFACT_FILE}: {rel}")
        if target is not None:
            write_new_file(target, data)
            written += 1
    if at != len(blob):
        raise ValueError("compile artifacts: the blob's index does not match its length")
    return written
