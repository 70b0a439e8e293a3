"""Volume keys: checking, generating, and sealing them under the store's master key.

A volume key (64 bytes: AES-XTS-256 takes two AES-256 keys) is kept only sealed:
AES-256-GCM under a 32-byte master key, with a fresh 96-bit nonce and the volume id
as associated data, so a sealed key copied onto another volume's row fails to open.
The raw key lives only in the memory of the process using it; it is never logged,
returned, written unsealed, or put in an exception message or a repr.

Where the master key comes from is the backend's business. The file backend keeps it
in `<store dir>/master.key` (32 random bytes, mode 0600, created on first use). On a
BlueField it would come from the platform's secure storage instead (a TPM-sealed blob
or the DPU's secure-boot key store), so that a copy of the disk alone opens nothing.
"""

from __future__ import annotations

import secrets
from typing import Final

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from dpu_agent.errors import FailedPrecondition, InvalidArgument
from dpu_agent.storage.errors import DataCorruption

KEY_BYTES: Final = 64
MASTER_KEY_BYTES: Final = 32
_NONCE_BYTES: Final = 12
_SEAL_VERSION: Final = b"\x01"


def check_key(key: object) -> bytes:
    """A supplied key: 64 bytes whose two halves differ (XTS needs two distinct keys)."""
    if not isinstance(key, bytes | bytearray | memoryview):
        raise InvalidArgument("encryption key must be 64 bytes")
    raw = bytes(key)
    if len(raw) != KEY_BYTES:
        raise InvalidArgument("encryption key must be 64 bytes")
    if raw[: KEY_BYTES // 2] == raw[KEY_BYTES // 2 :]:
        raise InvalidArgument("encryption key halves must differ (AES-XTS uses two keys)")
    return raw


def generate_key() -> bytes:
    """A fresh random volume key."""
    while True:
        key = secrets.token_bytes(KEY_BYTES)
        if key[: KEY_BYTES // 2] != key[KEY_BYTES // 2 :]:
            return key


class KeySealer:
    """Seals and unseals volume keys with AES-256-GCM under a master key."""

    __slots__ = ("_aead",)

    def __init__(self, master_key: bytes) -> None:
        if len(master_key) != MASTER_KEY_BYTES:
            raise FailedPrecondition(f"the master key must be {MASTER_KEY_BYTES} bytes")
        self._aead = AESGCM(master_key)

    def __repr__(self) -> str:
        return "KeySealer(<master key hidden>)"

    def seal(self, volume_id: str, key: bytes) -> bytes:
        """The sealed form of `key`, bound to `volume_id`."""
        nonce = secrets.token_bytes(_NONCE_BYTES)
        return _SEAL_VERSION + nonce + self._aead.encrypt(nonce, key, volume_id.encode())

    def unseal(self, volume_id: str, sealed: bytes) -> bytes:
        """The key sealed for `volume_id`; DataCorruption if it does not open."""
        version, nonce, body = sealed[:1], sealed[1 : 1 + _NONCE_BYTES], sealed[1 + _NONCE_BYTES :]
        if version != _SEAL_VERSION:
            raise DataCorruption(f"volume {volume_id!r}: its sealed key has an unknown format")
        try:
            key = self._aead.decrypt(nonce, body, volume_id.encode())
        except InvalidTag:
            raise DataCorruption(
                f"volume {volume_id!r}: its key cannot be unsealed "
                "(the master key changed, or the sealed key was damaged)"
            ) from None
        if len(key) != KEY_BYTES:
            raise DataCorruption(f"volume {volume_id!r}: its unsealed key has the wrong size")
        return key
