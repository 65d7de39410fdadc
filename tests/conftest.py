from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest
import torch

from tests.helpers import NATIVE_ISAS, runnable_isas
from tests.tiny_models import KINDS, make_tiny_model
from warmboot.config import EAGER_ENV

torch.set_num_threads(2)
# NOTE: engines that do not say run eagerly in the suite (a compile per engine would cost
# minutes); the parity, loop and snapshot tests that cover the compiled steps ask for them
# (``compiled_default``) or pass enforce_eager=False.
os.environ.setdefault(EAGER_ENV, "1")
# Restores are restores here: no start path chosen by what earlier tests' starts cost.
os.environ.setdefault("WARMBOOT_START_BY_COST", "0")


@pytest.fixture(params=["compiled", "eager"])
def step_mode(request, monkeypatch):
    """Run the test twice: engines that do not say compile their steps (the product's CPU
    default), then run eagerly (``enforce_eager=True``)."""
    monkeypatch.setenv(EAGER_ENV, "0" if request.param == "compiled" else "1")
    return request.param


@pytest.fixture
def compiled_default(monkeypatch):
    """Engines that do not say compile their steps, as outside the suite."""
    monkeypatch.setenv(EAGER_ENV, "0")


@pytest.fixture
def own_cache(monkeypatch, tmp_path) -> Path:
    """A fresh ``$WARMBOOT_CACHE`` that shares the suite's native library (``native/``): an
    engine that finds no library starts the detached builder, which would take a minute of
    both cores from the tests after it."""
    from warmboot.config import cache_root

    native = cache_root() / "native"
    native.mkdir(parents=True, exist_ok=True)
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "native").symlink_to(native, target_is_directory=True)
    monkeypatch.setenv("WARMBOOT_CACHE", str(cache))
    return cache


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """Return a function kind -> directory of a tiny random model (built once per session)."""
    root = tmp_path_factory.mktemp("tiny-models")

    @functools.cache
    def build(kind: str, dtype: str = "float32") -> Path:
        return make_tiny_model(kind, root / f"{kind}-{dtype}", dtype=dtype)

    return build


@pytest.fixture(scope="session")
def hf_model():
    """kind directory -> the transformers reference model (float32, eager attention)."""
    from transformers import AutoModelForCausalLM

    @functools.cache
    def load(path: Path, dtype: str = "float32"):
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=getattr(torch, dtype), attn_implementation="eager"
        )
        return model.eval()

    return load


@pytest.fixture(scope="module")
def one_torch_thread():
    """Torch on one thread for a module (the snapshot tests' engines share two cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(params=KINDS)
def kind(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def path(tiny_model_dir) -> Path:
    """The tiny Llama most behaviour tests use."""
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def hf(path, hf_model):
    """Its transformers reference."""
    return hf_model(path)


@pytest.fixture(scope="module")
def s3_endpoint():
    """A moto S3 server on 127.0.0.1 (port chosen by the OS) with a bucket "snaps", and
    credentials in the env."""
    pytest.importorskip("moto")
    import boto3
    from moto.server import ThreadedMotoServer

    mp = pytest.MonkeyPatch()
    for name, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        mp.setenv(name, value)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    mp.setenv("AWS_ENDPOINT_URL_S3", endpoint)
    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="snaps")
    yield endpoint
    server.stop()
    mp.undo()


@pytest.fixture(params=NATIVE_ISAS)
def isa(request):
    """Each native instruction set this CPU runs, forced for the test (skipped where it
    lacks one); the CPU's best again after it."""
    if request.param not in runnable_isas():
        pytest.skip(f"this CPU cannot run {request.param}")
    best = runnable_isas()[-1]
    torch.ops.warmboot_cpu.use_isa(request.param)
    yield request.param
    torch.ops.warmboot_cpu.use_isa(best)
