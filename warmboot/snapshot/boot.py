"""The engine's side of tier-A snapshots: find a snapshot matching the compatibility key,
restore the runner's weights from it, check the warm-up canary, or publish one after a cold
boot. Every failure is turned into a logged reason and a cold boot; nothing here raises."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

import torch

from warmboot.snapshot.canary import HALF_ATOL, canary_mismatch
from warmboot.snapshot.compile_artifacts import (
    ARTIFACT_FILE,
    NATIVE_FILE,
    load_artifacts,
    load_native,
    saved_native,
)
from warmboot.snapshot.deadline import run_with_deadline
from warmboot.snapshot.image import Manifest, SnapshotError, dtype_name, verify_chunk
from warmboot.snapshot.key import diff_fields, key_digest, key_fields
from warmboot.snapshot.lease import holder, try_lease
from warmboot.snapshot.publish import publish_image, runtime_files, triton_cache_dir
from warmboot.snapshot.restore import restore_files, restore_tensors
from warmboot.snapshot.store import Store, open_store

log = logging.getLogger("warmboot")
MAX_MANIFESTS_COMPARED = 32


class SnapshotBoot:
    """One engine start's snapshot decision. ``reason`` says why the last step went as it did."""

    def __init__(
        self,
        store: str | Path | Store,
        model_dir: Path,
        settings: dict[str, object],
        device: torch.device,
        timeout_s: float = 30.0,
    ):
        self.store = open_store(store)
        self.timeout_s = timeout_s
        self.model_dir = model_dir
        self.device = device
        self.fields = key_fields(model_dir, settings, device)
        self.key = key_digest(self.fields)
        self.manifest: Manifest | None = None
        self.reason = ""
        self.publish_note = ""
        self.publish_skipped = False
        """Not restored because a cold start is quicker here (``start_costs``): the image
        stays as it is."""
        """How the publish went (published, not published and why, failed and why)."""

    # -- restore --------------------------------------------------------------------------------
    def lookup(self) -> Manifest | None:
        """The manifest for this engine's key, or None with ``reason`` set."""
        try:
            manifest = run_with_deadline("snapshot lookup", self._fetch_manifest, self.timeout_s)
            if manifest is None:
                return None
        except Exception as e:  # noqa: BLE001 - any failure means a cold boot, with its reason
            self.reason = f"snapshot store {self.store.url}: {_describe(e)}"
            return None
        diff = diff_fields(self.fields, manifest.fields)
        if diff or manifest.key != self.key:
            detail = "; ".join(diff) or f"manifest key {manifest.key}"
            self.reason = f"snapshot {self.key} in {self.store.url} does not match: {detail}"
            return None
        self.manifest = manifest
        return manifest

    def _fetch_manifest(self, progress) -> Manifest | None:
        data = self.store.get_manifest(self.key)
        progress(0)
        if data is None:
            self.reason = self._no_match_reason(progress)
            return None
        return Manifest.from_json(data, where=f"snapshot {self.key}")

    def _no_match_reason(self, progress) -> str:
        base = f"no snapshot for key {self.key} in {self.store.url}"
        closest: list[str] | None = None
        for key in self.store.list_keys()[:MAX_MANIFESTS_COMPARED]:
            try:
                other = Manifest.from_json(self.store.get_manifest(key) or b"", where=key)
            except SnapshotError:
                continue
            finally:
                progress(0)
            diff = diff_fields(self.fields, other.fields)
            if closest is None or len(diff) < len(closest):
                closest, closest_key = diff, key
        if closest is None:
            return base
        return f"{base}; the closest, {closest_key}, differs in: {'; '.join(closest)}"

    def restore(
        self, manifest: Manifest, dtype: torch.dtype, mapped: bool = False, progress=None
    ) -> dict[str, torch.Tensor] | None:
        """Verified tensors on the engine's device, or None with ``reason`` set. ``mapped``:
        map the store's chunk files (a process image then holds no weights) instead of copying
        them into memory the store cannot change. ``progress(n)`` hears the bytes restored."""

        def step(progress) -> dict[str, torch.Tensor]:
            out = restore_tensors(self.store, manifest, self.device, progress, use_mmap=mapped)
            if self.device.type == "cuda":
                restore_files(self.store, manifest, "triton_cache", triton_cache_dir())
            return out

        try:
            tensors = run_with_deadline("snapshot restore", step, self.timeout_s, None, progress)
            _check_dtypes(tensors, dtype)
            _adopt_autotune(manifest.facts.get("autotune"))
        except Exception as e:  # noqa: BLE001 - any failure means a cold boot, with its reason
            self.reason = f"restore from {self.store.url} failed: {_describe(e)}"
            return None
        gb = manifest.tensor_bytes / 1e9
        self.reason = f"snapshot {self.key} matches ({len(tensors)} tensors, {gb:.3f} GB verified)"
        return tensors

    def canary_matches(self, canary: list[tuple[int, float]], dtype: torch.dtype) -> bool:
        """Whether the warm-up canary reproduces the one recorded at the cold boot (see
        ``snapshot.canary``; a half-precision ``dtype`` allows ``HALF_ATOL``); a snapshot
        without one never matches."""
        want = (self.manifest.facts if self.manifest else {}).get("canary")
        if not isinstance(want, list):
            self.reason = "the snapshot records no canary"
            return False
        try:
            half = dtype in (torch.bfloat16, torch.float16)
            why = canary_mismatch(want, canary, HALF_ATOL if half else 0.0)
        except (TypeError, ValueError, IndexError):
            why = f"the snapshot's canary is malformed: {str(want)[:80]}"
        if why is not None:
            self.reason = f"warm-up {why}"
        return why is None

    # -- publish --------------------------------------------------------------------------------
    def compile_artifacts(self) -> str:
        """Load the restored image's compile artifacts (verified chunk, then our MAC) into
        inductor's caches; returns what happened, in words. Never raises."""
        return self._load_code(ARTIFACT_FILE, "compile_artifacts", load_artifacts)

    def native_library(self) -> str:
        """Place the restored image's native kernels library (verified chunk, then our MAC)
        into the cache, so nothing is built; returns what happened, in words. Never raises."""
        return self._load_code(NATIVE_FILE, "native_library", load_native)

    def _load_code(self, path: str, fact: str, load) -> str:
        files = self.manifest.files if self.manifest else ()
        facts = self.manifest.facts.get(fact) if self.manifest else None
        entry = next((f for f in files if f.path == path), None)
        what = fact.replace("_", " ")
        if facts is None or entry is None:
            return f"the snapshot carries no {what}"

        def step(progress) -> str:
            data = self.store.get_chunk(entry.chunk.hash, entry.chunk.size)
            progress(len(data))
            verify_chunk(data, entry.chunk.hash, f"file {entry.path}")
            return load(data, facts)

        try:
            return run_with_deadline(what, step, self.timeout_s)
        except Exception as e:  # noqa: BLE001 - then the engine compiles or builds, and says why
            return f"{what} not loaded: {_describe(e)}"

    def publish(
        self, model: torch.nn.Module, facts: dict[str, Any], artifacts=None
    ) -> Manifest | None:
        """Publish this engine's image under a lease (one publisher per key across servers);
        ``artifacts``: (blob, facts) of the compiles (``compile_artifacts.saved_artifacts``).
        A failure or a stalled store (lease, chunks or manifest) is logged, never raised."""
        try:
            manifest, written = run_with_deadline(
                "snapshot publish",
                lambda p: self._publish(model, facts, artifacts, p),
                self.timeout_s,
            )
        except Exception as e:  # noqa: BLE001 - serving goes on without a snapshot
            self.publish_note = f"publish failed: {_describe(e)}"
            log.warning("snapshot publish to %s failed: %s", self.store.url, _describe(e))
            return None
        if manifest is None:
            self.publish_note = f"not published: {written}"
            log.info("snapshot %s not published: %s", self.key, written)
            return None
        self.publish_note = f"published {self.key}"
        log.info(
            "published snapshot %s to %s: %.3f GB of tensors, %.3f GB new",
            self.key,
            self.store.url,
            manifest.tensor_bytes / 1e9,
            written / 1e9,
        )
        return manifest

    def _publish(self, model, facts, artifacts, progress) -> tuple[Manifest | None, int | str]:
        """(manifest, bytes written), or (None, why not) when another server publishes."""
        name = f"publish-{self.key}"
        lease = try_lease(self.store, name)
        if lease is None:
            return None, f"{holder(self.store, name)} holds the publish lease"
        try:
            progress(0)
            if self.store.get_manifest(self.key) is not None:
                return None, "another server published it meanwhile"
            tensors = [(n, p) for n, p in model.named_parameters()]
            files: dict[str, Path | bytes] = dict(runtime_files(self.model_dir, self.device))
            extra = {"model_dir": str(self.model_dir)}
            facts = facts | _autotune_facts()
            if artifacts is not None:
                files[ARTIFACT_FILE] = artifacts[0]
                facts = facts | {"compile_artifacts": artifacts[1]}
            if (lib := saved_native()) is not None:
                files[NATIVE_FILE] = lib[0]
                facts = facts | {"native_library": lib[1]}
            return publish_image(
                self.store, self.key, self.fields, tensors, files, facts, progress, extra=extra
            )
        finally:
            lease.release()


def _autotune_facts() -> dict[str, Any]:
    """The attention kernels' measured launch configs, if this process used them (importing
    the tuner would pull Triton into CPU-only engines)."""
    tuning = sys.modules.get("warmboot.kernels.tuning")
    entries = tuning.export_autotune_cache() if tuning else {}
    return {"autotune": entries} if entries else {}


def _adopt_autotune(entries: Any) -> None:
    """Configs measured by the publisher: this start skips their tuning. Malformed entries
    (the manifest is data, not trusted code) are ignored, never launched."""
    if not isinstance(entries, dict) or not entries:
        return
    good = {
        k: cfg
        for k, cfg in entries.items()
        if isinstance(k, str)
        and isinstance(cfg, dict)
        and all(isinstance(n, str) and n.isidentifier() and type(v) is int for n, v in cfg.items())
    }
    if len(good) != len(entries):
        log.warning("ignoring %d malformed autotune entries", len(entries) - len(good))
    if good:
        from warmboot.kernels.tuning import import_autotune_cache

        import_autotune_cache(good)


def _describe(e: Exception) -> str:
    return str(e) if isinstance(e, SnapshotError) else f"{type(e).__name__}: {e}"


def _check_dtypes(tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
    """Every weight is the dtype the engine holds it in (``param_dtype``): a float weight
    listed as ``int32`` (same item size, right hash) would otherwise pass and crash the warm-up."""
    from warmboot.models.loader import param_dtype
    from warmboot.models.quant_loader import quant_dtype_ok, snapshot_modules

    quant = snapshot_modules(tensors)

    def ok(name: str, t: torch.Tensor) -> bool:
        held = quant_dtype_ok(name, t, quant)
        return t.dtype == param_dtype(name, dtype) if held is None else held

    bad = [n for n, t in tensors.items() if not ok(n, t)]
    if bad:
        raise ValueError(f"tensors {bad[:3]} are not {dtype_name(dtype)}")
