"""The process image rewrite (``launcher/runsc_image``) on images built in runsc's layout;
a real one is restored in ``test_launcher`` (runsc needed)."""

import hashlib
import hmac
import json
import random
import zlib

import pytest

from warmboot.launcher import runsc_image
from warmboot.launcher.runsc_image import MAGIC, ImageLayoutError, chunk_kinds, unpack

CHUNK = 1 << 16
RNG = random.Random(7)
WORDS = [bytes(RNG.randbytes(RNG.randint(2, 9))) for _ in range(4000)]
NOISE = RNG.randbytes(CHUNK)  # NOTE: deflate cannot shrink it: stored
TEXT = b" ".join(RNG.choice(WORDS) for _ in range(20000))[:CHUNK]  # NOTE: shrinks < 5x
ZEROS = bytes(CHUNK)  # NOTE: shrinks ~1000x: stays deflated
RAWS = [NOISE, ZEROS, TEXT, ZEROS, NOISE[: CHUNK // 3]]


def _deflated(raw: bytes) -> bytes:
    deflater = zlib.compressobj(1, zlib.DEFLATED, -15)
    return deflater.compress(raw) + deflater.flush()


def _image(raws=RAWS, meta=None, key=b"", tail=b"") -> bytes:
    """An image as this runsc writes it: header, metadata, HMAC, chunk size, chunks."""
    meta_bytes = json.dumps(meta or {"cpu_usage": "1.5s"}).encode()
    head = MAGIC + len(meta_bytes).to_bytes(8, "big") + meta_bytes
    out = head + hmac.new(key, head, hashlib.sha256).digest() + CHUNK.to_bytes(4, "big")
    for raw in raws:
        data = _deflated(raw)
        out += len(data).to_bytes(4, "big") + data
    return out + tail


def _flipped(image: bytes) -> bytes:
    """Bits flipped inside the last chunk's deflate data."""
    return image[:-2000] + bytes(b ^ 0x55 for b in image[-2000:-1000]) + image[-1000:]


def _chunks(data: bytes) -> list[bytes]:
    """The inflated chunks of an image (parsed here, not with the module under test)."""
    n = int.from_bytes(data[8:16], "big")
    pos, raws = 16 + n + 32 + 4, []
    while pos < len(data):
        size = int.from_bytes(data[pos : pos + 4], "big")
        raws.append(zlib.decompress(data[pos + 4 : pos + 4 + size], -15))
        pos += 4 + size
    return raws


def test_chunks_deflate_barely_shrinks_are_stored_and_the_rest_kept(tmp_path):
    path = tmp_path / "checkpoint.img"
    original = _image()
    path.write_bytes(original)
    assert chunk_kinds(path) == (2, 3), "deflate stores the noise itself"
    done = unpack(path)
    data = path.read_bytes()
    assert (done.chunks, done.stored, done.before, done.after) == (5, 3, len(original), len(data))
    grown = CHUNK - len(_deflated(TEXT))  # NOTE: the text stored (block headers aside)
    assert len(data) - len(original) == pytest.approx(grown, abs=64)
    assert chunk_kinds(path) == (3, 2), "the zero chunks stay deflated"
    assert _chunks(data) == RAWS, "every chunk inflates to what it held"
    head = 16 + int.from_bytes(original[8:16], "big") + 36
    assert data[:head] == original[:head], "header, metadata, HMAC and chunk size unchanged"
    assert not list(tmp_path.glob("*.unpacking"))
    unpack(path)
    assert path.read_bytes() == data, "a second rewrite changes nothing"


@pytest.mark.parametrize(
    "image, why",
    [
        (_image(meta={"compression": "none"}), "not deflated"),
        (_image(key=b"secret"), "unkeyed HMAC"),
        (_image()[:-7], "do not run to the end"),
        (_image(tail=b"\0\0\0\1x"), "do not run to the end"),
        (_image(raws=[NOISE + b"x"]), "past the chunk size"),
        (_image(raws=[NOISE]) + (1 << 30).to_bytes(4, "big"), "bytes deflated"),
        (_flipped(_image(raws=[TEXT])), "inflate|one deflate stream|chunk size"),
        (b"not an image at all", "not a gVisor state file"),
    ],
    ids=[
        "uncompressed",
        "keyed",
        "truncated",
        "trailing",
        "oversized",
        "huge",
        "garbage",
        "foreign",
    ],
)
def test_an_image_in_another_layout_is_left_as_runsc_wrote_it(tmp_path, image, why):
    path = tmp_path / "checkpoint.img"
    path.write_bytes(image)
    with pytest.raises(ImageLayoutError, match=why):
        unpack(path)
    assert path.read_bytes() == image and not list(tmp_path.glob("*.unpacking"))
    assert runsc_image.unpack_or_keep(path) is None and path.read_bytes() == image
