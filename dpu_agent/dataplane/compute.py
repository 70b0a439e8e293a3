"""Compute kernels of compute jobs: streaming transforms with bounded memory.

No I/O here: the job runner READs the input from host memory chunk by chunk, feeds each
chunk to a transform on a worker thread (the libraries release the GIL), and WRITEs the
output as it comes. A transform never holds more than one chunk of output at a time,
however much the input expands: `feed` returns at most `step` bytes and `more()` says
whether the same input has more to give (a decompression bomb is drained a chunk at a
time and stopped at the destination's size), and the decoders' windows are bounded
(`ZSTD_WINDOW_LOG_MAX`). An encoder's output for one chunk is bounded by the chunk (plus a
frame's few bytes of overhead), so encoders return it whole, without a copy to re-slice
it; the input is read in place (a view of the staging buffer, not a copy). A job's last
chunk is fed with `last=True`, so an encoder returns what it held back in the same call:
one worker round trip per chunk. `start` (a nonce or frame header) and `finish` (a tag,
a check that the frame ended) are a few bytes each and run on the reactor. Every failure
is a domain error.

Formats: COMPRESS writes one LZ4 frame or one Zstandard frame (level 3); DECOMPRESS
reads one; ENCRYPT writes nonce (12 random bytes) ‖ AES-GCM ciphertext ‖ tag (16),
DECRYPT the reverse. Decryption streams too: plaintext is written before the tag is
checked at the end, so on DATA_LOSS the destination holds unauthenticated bytes
(`bytes_written` says how many) that the host must not use.
"""

from __future__ import annotations

import abc
import hashlib
import os
import sys
import threading
from typing import Final

import crc32c as crc32c_lib
import lz4.frame
import zstandard
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from dpu_agent.errors import DataLoss, InvalidArgument
from dpu_wire.jobkinds import CODECS, JobKind

if sys.version_info >= (3, 14):
    from compression import zstd as zstd_stream
else:
    from backports import zstd as zstd_stream

NONCE_BYTES: Final = 12
TAG_BYTES: Final = 16
KEY_SIZES: Final = (16, 24, 32)
ZSTD_LEVEL: Final = 3
ZSTD_WINDOW_LOG_MAX: Final = 24  # a Zstandard frame may ask for at most a 16 MiB window


def check_key(key: bytes) -> bytes:
    """An AES key of 16, 24 or 32 bytes (the message never contains the key)."""
    if len(key) not in KEY_SIZES:
        raise InvalidArgument(f"an AES-GCM key is 16, 24 or 32 bytes, not {len(key)}")
    return key


def crc32c(data: memoryview | bytes, value: int = 0) -> int:
    """CRC-32C (Castagnoli) of `data`, continuing from `value`."""
    return int(crc32c_lib.crc32c(data, value=value))


class Transform(abc.ABC):
    """Input chunks in, output chunks out; used by one job, one call at a time.

    `feed` does the work (on a compute worker); `start` and `finish` give a few bytes
    and check a frame's end or a tag, cheap enough for the reactor thread.
    """

    def start(self) -> bytes:
        """The output's first bytes, due before any input (a nonce, a frame header)."""
        return b""

    @abc.abstractmethod
    def feed(self, data: bytes | memoryview, step: int, *, last: bool = False) -> bytes:
        """Take `data` (b"" to drain) and return its output.

        A decoder returns at most `step` bytes, an encoder what the chunk gives (at most
        its size plus a frame's overhead). `last`: `data` ends the input, so an encoder
        returns what it held back too (all but `finish`'s few bytes). `data` is only read
        during the call (it may be a view of a reused buffer).
        """

    def feed_into(
        self, data: bytes | memoryview, out: memoryview, step: int, *, last: bool = False
    ) -> tuple[int, bytes | memoryview]:
        """`feed`, with the output's first bytes placed in `out`: (how many, the rest).

        `out` is the free part of the job's output buffer. Called on the compute worker,
        so the copy into it is the worker's, not the reactor's; a transform that can
        write its output there directly does (`_Encrypt`). The rest is non-empty only
        when `out` is full.
        """
        produced = memoryview(self.feed(data, step, last=last))
        placed = min(len(produced), len(out))
        out[:placed] = produced[:placed]
        return placed, produced[placed:]

    def more(self) -> bool:
        """Whether the input given so far has output left (call `feed(b"", step)`)."""
        return False

    @abc.abstractmethod
    def finish(self) -> bytes:
        """After the last input: its last few bytes (a tag), once the checks passed."""


_local = threading.local()


def _zstd_compressor() -> zstandard.ZstdCompressor:
    """This thread's one-shot Zstandard compressor, kept for its next job.

    A compressor's context holds large tables that it zeroes when it is set up. Made
    afresh for every job, on worker threads that allocate and free in turn, they cost
    page faults and a memset on top of the compression (perf; docs/performance-history.md,
    "One-shot zstd COMPRESS jobs reuse their worker's compressor").
    """
    found: zstandard.ZstdCompressor | None = getattr(_local, "zstd", None)
    if found is None:
        found = _local.zstd = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
    return found


class _Compress(Transform):
    """One frame whose header records the input's size (`total`), as one-shot APIs write.

    An input that comes in one chunk is compressed in one call (Zstandard's one-shot
    API, about 1.7 times faster than its stream for 1 MiB) with the worker thread's own
    compressor; a longer one is streamed with a compressor of its own (its chunks may
    run on different workers).
    """

    def __init__(self, codec: str, total: int) -> None:
        self._codec = codec
        self._total = total
        self._flushed = False
        self._zstd: zstandard.ZstdCompressionObj | None = None
        if codec == "lz4":
            self._lz4 = lz4.frame.LZ4FrameCompressor()
            self._head = bytes(self._lz4.begin(source_size=total))  # the LZ4 frame header
        else:
            self._head = b""

    def start(self) -> bytes:
        return self._head

    def feed(self, data: bytes | memoryview, step: int, *, last: bool = False) -> bytes:  # noqa: ARG002 - see feed
        if self._codec == "lz4":
            out = bytes(self._lz4.compress(data)) if data else b""
            return out + self._flush() if last else out
        if last and self._zstd is None and len(data) == self._total:
            self._flushed = True
            return _zstd_compressor().compress(data)
        if self._zstd is None:
            ctx = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
            self._zstd = ctx.compressobj(size=self._total)
        out = bytes(self._zstd.compress(data)) if data else b""
        return out + self._flush() if last else out

    def _flush(self) -> bytes:
        if self._flushed:
            return b""
        self._flushed = True
        if self._codec == "lz4":
            return bytes(self._lz4.flush())
        if self._zstd is None:  # no input at all: an empty frame
            return _zstd_compressor().compress(b"")
        return bytes(self._zstd.flush())

    def finish(self) -> bytes:
        return self._flush()  # b"" after feed(last=True); an empty input's frame is small


class _Decompress(Transform):
    def __init__(self, codec: str) -> None:
        self._codec = codec
        if codec == "lz4":
            self._dec: lz4.frame.LZ4FrameDecompressor | zstd_stream.ZstdDecompressor = (
                lz4.frame.LZ4FrameDecompressor()
            )
        else:
            self._dec = zstd_stream.ZstdDecompressor(
                options={zstd_stream.DecompressionParameter.window_log_max: ZSTD_WINDOW_LOG_MAX}
            )

    def feed(self, data: bytes | memoryview, step: int, *, last: bool = False) -> bytes:  # noqa: ARG002 - see feed
        if self._dec.eof:  # DP-2.7-4: the source is one frame, nothing after it
            if data:
                raise self._after_frame()
            return b""
        # The LZ4 decompressor keeps a slice of input it did not consume: give it a copy.
        # The Zstandard one copies what it keeps.
        chunk = bytes(data) if self._codec == "lz4" else data
        try:
            out = bytes(self._dec.decompress(chunk, max_length=step))
        except (RuntimeError, zstd_stream.ZstdError) as exc:
            raise InvalidArgument(f"the input is not a valid {self._codec} frame ({exc})") from None
        if self._dec.eof and self._dec.unused_data:
            raise self._after_frame()
        return out

    def _after_frame(self) -> InvalidArgument:
        return InvalidArgument(f"the input holds bytes after its {self._codec} frame")

    def more(self) -> bool:
        return not self._dec.needs_input and not self._dec.eof

    def finish(self) -> bytes:  # nothing is held back: only the frame's end is checked
        if not self._dec.eof:
            raise InvalidArgument(f"the input ends before its {self._codec} frame does")
        return b""


class _Encrypt(Transform):
    def __init__(self, key: bytes) -> None:
        self._nonce = os.urandom(NONCE_BYTES)
        self._enc = Cipher(algorithms.AES(check_key(key)), modes.GCM(self._nonce)).encryptor()

    def start(self) -> bytes:
        return self._nonce

    def feed(self, data: bytes | memoryview, step: int, *, last: bool = False) -> bytes:  # noqa: ARG002 - see feed
        return self._enc.update(data)

    def feed_into(
        self,
        data: bytes | memoryview,
        out: memoryview,
        step: int,  # noqa: ARG002 - see feed
        *,
        last: bool = False,  # noqa: ARG002 - see feed
    ) -> tuple[int, bytes | memoryview]:
        """Encrypt straight into `out` (GCM's output is as long as its input)."""
        view = memoryview(data)
        placed = min(len(view), len(out))
        if placed:
            self._enc.update_into(view[:placed], out[:placed])
        return placed, self._enc.update(view[placed:]) if placed < len(view) else b""

    def finish(self) -> bytes:
        return self._enc.finalize() + self._enc.tag


class _Decrypt(Transform):
    """nonce ‖ ciphertext ‖ tag, where the caller says how long the whole input is."""

    def __init__(self, key: bytes, total: int) -> None:
        if total < NONCE_BYTES + TAG_BYTES:
            raise InvalidArgument(f"the input is shorter than nonce and tag ({total} bytes)")
        self._key = check_key(key)
        self._total = total
        self._seen = 0
        self._head = b""  # the nonce, while it is incomplete
        self._tag = b""
        self._dec: object | None = None

    def feed(self, data: bytes | memoryview, step: int, *, last: bool = False) -> bytes:  # noqa: ARG002 - see feed
        out = b""
        if data:
            view = memoryview(data)
            start = self._seen
            self._seen += len(view)
            if start < NONCE_BYTES:
                take = min(NONCE_BYTES - start, len(view))
                self._head += bytes(view[:take])
                view = view[take:]
                start += take
                if len(self._head) == NONCE_BYTES:
                    self._dec = Cipher(algorithms.AES(self._key), modes.GCM(self._head)).decryptor()
            body_end = self._total - TAG_BYTES
            body = view[: max(0, body_end - start)]
            self._tag += bytes(view[len(body) :])
            if body and self._dec is not None:
                out = self._dec.update(body)  # type: ignore[attr-defined]
        return out

    def finish(self) -> bytes:  # GCM holds nothing back: only the tag is checked
        if self._dec is None:
            return b""
        dec, self._dec = self._dec, None
        try:
            return bytes(dec.finalize_with_tag(self._tag))  # type: ignore[attr-defined]
        except (InvalidTag, ValueError):
            raise DataLoss("AES-GCM authentication failed: wrong key or altered data") from None


def transform(kind: JobKind, parameter: int, key: bytes, total: int) -> Transform:
    """The transform of a COMPRESS/DECOMPRESS/ENCRYPT/DECRYPT job over `total` input bytes."""
    if kind in (JobKind.COMPRESS, JobKind.DECOMPRESS):
        codec = CODECS.get(parameter)
        if codec is None:
            raise InvalidArgument(f"unknown compression format {parameter} (1 lz4, 2 zstd)")
        return _Compress(codec, total) if kind == JobKind.COMPRESS else _Decompress(codec)
    if kind == JobKind.ENCRYPT:
        return _Encrypt(key)
    if kind == JobKind.DECRYPT:
        return _Decrypt(key, total)
    raise InvalidArgument(f"{kind.name} is not a transform")


def sha256() -> hashlib._Hash:
    """A SHA-256 accumulator (its update releases the GIL for large inputs)."""
    return hashlib.sha256()
