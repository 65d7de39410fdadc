from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

from tests.tiny_models import KINDS, make_tiny_model

torch.set_num_threads(2)


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
