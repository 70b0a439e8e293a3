"""Compute kernels of compute jobs: pure functions from input bytes to output bytes.

No I/O here: the job runner READs the input from host memory, calls one of these (in
a worker thread), and WRITEs the output. Every failure is a domain error; a
decompression never produces more than the destination can take.
"""

from __future__ import annotations

import os
from typing import Final

import lz4.frame
import zstandard
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from dpu_agent.errors import DataLoss, InvalidArgument

FORMAT_LZ4: Final = 1
FORMAT_ZSTD: Final = 2
FORMATS: Final = {FORMAT_LZ4: "lz4", FORMAT_ZSTD: "zstd"}
NONCE_BYTES: Final = 12
TAG_BYTES: Final = 16
KEY_SIZES: Final = (16, 24, 32)
ZSTD_LEVEL: Final = 3


def check_format(fmt: int) -> str:
    """The format's name, or InvalidArgument."""
    if fmt not in FORMATS:
        raise InvalidArgument(f"unknown compression format {fmt} (1 lz4, 2 zstd)")
    return FORMATS[fmt]


def check_key(key: bytes) -> bytes:
    """An AES key of 16, 24 or 32 bytes (the message never contains the key)."""
    if len(key) not in KEY_SIZES:
        raise InvalidArgument(f"an AES-GCM key is 16, 24 or 32 bytes, not {len(key)}")
    return key


def compress(fmt: int, data: bytes | bytearray) -> bytes:
    """A self-describing frame of `data`."""
    if check_format(fmt) == "lz4":
        return bytes(lz4.frame.compress(bytes(data)))
    return zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(bytes(data))


def decompress(fmt: int, data: bytes | bytearray, limit: int) -> bytes:
    """The data in a frame; InvalidArgument if it is not one or would exceed `limit`."""
    name = check_format(fmt)
    try:
        if name == "lz4":
            decoder = lz4.frame.LZ4FrameDecompressor()
            out = bytes(decoder.decompress(bytes(data), max_length=limit))
            complete = decoder.eof
        else:
            out = zstandard.ZstdDecompressor().decompress(bytes(data), max_output_size=limit)
            complete = True
    except (RuntimeError, zstandard.ZstdError) as exc:
        raise InvalidArgument(f"the input is not a valid {name} frame ({exc})") from None
    if not complete:
        raise InvalidArgument(f"the decompressed data exceeds the destination ({limit} bytes)")
    return out


def encrypt(key: bytes, data: bytes | bytearray) -> bytes:
    """Nonce || ciphertext || tag, with a fresh random nonce."""
    nonce = os.urandom(NONCE_BYTES)
    return nonce + AESGCM(check_key(key)).encrypt(nonce, bytes(data), None)


def decrypt(key: bytes, data: bytes | bytearray) -> bytes:
    """The plaintext of nonce || ciphertext || tag; DataLoss if the tag does not verify."""
    if len(data) < NONCE_BYTES + TAG_BYTES:
        raise InvalidArgument(f"the input is shorter than nonce and tag ({len(data)} bytes)")
    nonce, sealed = bytes(data[:NONCE_BYTES]), bytes(data[NONCE_BYTES:])
    try:
        return AESGCM(check_key(key)).decrypt(nonce, sealed, None)
    except InvalidTag:
        raise DataLoss("AES-GCM authentication failed: wrong key or altered data") from None
