"""Inductor's compile artifacts in a tier-A image, so a restored engine does not compile.

``torch.compiler.save_cache_artifacts`` packs what this process's compiles produced and
looked up (dynamo's AOT-autograd and inductor's FX-graph cache entries: generated code and
the kernels built from it) into one blob; ``load_cache_artifacts`` puts it back into the
local caches, and the next trace of the same graphs hits them.

That blob is code, serialised with pickle inside torch, so the store's word is not enough:
besides the chunk hash every image entry has, the blob carries an HMAC under a key this
host (or fleet) holds, ``$WARMBOOT_ARTIFACT_KEY`` or a 0600 key file made on first use
(``artifact.key`` in the cache root). A blob whose MAC does not verify under our key is
never loaded: the engine compiles instead and says why. Weights stay plain tensors, never
unpickled, whatever the key. A sandboxed (tier-P) worker signs with the key of its own
sandbox: the host's key is never handed into a process image.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
from pathlib import Path

from warmboot.config import cache_root

log = logging.getLogger("warmboot")
ARTIFACT_FILE = "compile/inductor.bin"
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
    they cannot be signed (an image without them is still a good image)."""
    import torch

    try:
        saved = torch.compiler.save_cache_artifacts()
        if saved is None or not saved[0]:
            return None
        blob, info = saved
        signature = mac(blob)
    except Exception as e:  # noqa: BLE001 - publish the weights without the compile
        log.warning("compile artifacts left out of the snapshot: %s: %s", type(e).__name__, e)
        return None
    counts = {kind: len(keys) for kind, keys in info.artifacts.items()}
    return blob, {"file": ARTIFACT_FILE, "hmac": signature, "bytes": len(blob), "entries": counts}


def load_artifacts(blob: bytes, facts: object) -> str:
    """Load a verified blob into inductor's caches; returns what happened, in words."""
    if not isinstance(facts, dict) or not isinstance(facts.get("hmac"), str):
        return "the snapshot's compile artifacts record no MAC: not loaded"
    if not hmac.compare_digest(facts["hmac"], mac(blob)):
        return f"compile artifacts not signed with this host's key ({KEY_ENV}): not loaded"
    import torch

    info = torch.compiler.load_cache_artifacts(blob)
    counts = {kind: len(keys) for kind, keys in info.artifacts.items()} if info else {}
    return f"compile artifacts loaded ({len(blob)} bytes, {counts})"
