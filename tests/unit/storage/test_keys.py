"""Volume keys never leak: not in files, logs, exception texts, reprs or return values."""

import base64
import logging
import os
import secrets

import pytest

from dpu_agent.errors import AgentError
from dpu_agent.storage import Compression, DataServices, Encryption, FileVolumeStore
from dpu_agent.storage.keys import KEY_BYTES, KeySealer, check_key, generate_key

from .conftest import MiB, flip_stored_byte, make_store

XTS = DataServices(True, Compression.LZ4, Encryption.AES_XTS_256)
XTS_NO_CRC = DataServices(False, Compression.NONE, Encryption.AES_XTS_256)


def new_key() -> bytes:
    return generate_key()


def text_forms(key: bytes) -> list[str]:
    """Ways a key could show up in text."""
    forms = [
        key.hex(),
        key.hex().upper(),
        repr(key),
        base64.b64encode(key).decode(),
        str(list(key)),
    ]
    for half in (key[:32], key[32:]):
        forms += [half.hex(), repr(half)[2:-1], base64.b64encode(half).decode()]
    return forms


def binary_forms(key: bytes) -> list[bytes]:
    return [key, key[:32], key[32:], key.hex().encode()]


def exception_texts(exc: BaseException) -> list[str]:
    texts = []
    seen: BaseException | None = exc
    while seen is not None:
        texts += [str(seen), repr(seen), *map(str, seen.args)]
        seen = seen.__cause__ or seen.__context__
    return texts


def exercise(store, keys: dict[str, bytes]) -> list[str]:
    """Every call of the store on encrypted volumes, good and bad; the texts it produced."""
    texts: list[str] = []

    def expect_error(call) -> None:
        with pytest.raises(AgentError) as info:
            call()
        texts.extend(exception_texts(info.value))

    supplied = new_key()
    keys["supplied"] = supplied
    texts.append(repr(store.create("supplied", MiB, 4096, XTS, key=supplied)))
    texts.append(repr(store.create("generated", MiB, 4096, XTS)))
    texts.append(repr(store.create("nocrc", MiB, 512, XTS_NO_CRC, key=new_key())))
    keys["generated"] = store._volumes["generated"].key
    for v in ("supplied", "generated", "nocrc"):
        data = os.urandom(MiB // 2) + bytes(MiB // 2)
        store.write(v, 0, data, fua=True)
        assert store.read(v, 0, MiB) == data
        store.trim(v, 0, 8192)
        texts += [repr(store.get(v)), repr(store.stats(v)), repr(store._volumes[v])]
        texts.append(repr(store._volumes[v].codec))
        expect_error(lambda v=v: store.read(v, 100, 4096))
        expect_error(lambda v=v: store.write(v, 0, bytes(10)))
        expect_error(lambda v=v: store.resize(v, 0))
    texts.append(repr(store.resize("supplied", 2 * MiB)))
    texts.append(repr(store.list()))
    expect_error(lambda: store.create("supplied", MiB, 4096, XTS, key=supplied))
    for bad in (supplied[:63], supplied + b"x", supplied[:32] * 2, b""):
        expect_error(lambda bad=bad: store.create("other", MiB, 4096, XTS, key=bad))
    expect_error(lambda: store.create("plain", MiB, 4096, DataServices(), key=supplied))
    flip_stored_byte(store, "supplied", 4)
    expect_error(lambda: store.read("supplied", 0, MiB))
    texts += [repr(store), repr(store._sealer)]
    texts.append(repr(store._volumes["supplied"].node))
    texts.append(repr(store.create_snapshot("supplied", "snap")))
    texts.append(repr(store.clone("snap", "clone")))
    texts.append(repr(store.read("clone", 0, 8192)))
    expect_error(lambda: store.delete_snapshot("snap"))
    return texts


def assert_no_key_in(texts: list[str], keys: dict[str, bytes]) -> None:
    for name, key in keys.items():
        for form in text_forms(key):
            for text in texts:
                assert form not in text, f"the {name} key shows in {text[:80]!r}"


def test_keys_never_leak_from_the_file_store(tmp_path, caplog):
    caplog.set_level(logging.DEBUG)
    keys: dict[str, bytes] = {}
    store = FileVolumeStore(tmp_path / "s")
    try:
        texts = exercise(store, keys)
        files_while_open = {p: p.read_bytes() for p in (tmp_path / "s").rglob("*") if p.is_file()}
        store.delete("nocrc")
    finally:
        store.close()
    files_after = {p: p.read_bytes() for p in (tmp_path / "s").rglob("*") if p.is_file()}
    assert {p.name for p in files_while_open} >= {"pool", "checkpoint.0", "checkpoint.1"}
    for files in (files_while_open, files_after):
        for path, content in files.items():
            for name, key in keys.items():
                for form in binary_forms(key):
                    assert form not in content, f"the {name} key is in {path.name}"
    assert caplog.records, "the store logged nothing: the log check would prove nothing"
    assert_no_key_in([*texts, caplog.text, *(str(r.__dict__) for r in caplog.records)], keys)


def test_keys_never_leak_from_the_memory_store(tmp_path, caplog):
    caplog.set_level(logging.DEBUG)
    keys: dict[str, bytes] = {}
    with make_store("memory", tmp_path) as store:
        texts = exercise(store, keys)
    assert_no_key_in([*texts, caplog.text], keys)


@pytest.mark.parametrize("length", [0, 1, 32, 63, 65, 128])
def test_wrong_key_length_message_is_fixed(length):
    key = secrets.token_bytes(length)
    with pytest.raises(AgentError) as info:
        check_key(key)
    assert str(info.value) == "encryption key must be 64 bytes"


def test_generated_keys_are_fresh_and_valid():
    keys = {generate_key() for _ in range(8)}
    assert len(keys) == 8
    for key in keys:
        assert len(key) == KEY_BYTES
        assert check_key(key) == key


def test_sealed_key_opens_only_for_its_volume_and_master():
    key = generate_key()
    sealer = KeySealer(os.urandom(32))
    sealed = sealer.seal("v", key)
    assert key not in sealed
    assert sealer.unseal("v", sealed) == key
    assert sealer.seal("v", key) != sealed  # fresh nonce
    with pytest.raises(AgentError, match="cannot be unsealed"):
        sealer.unseal("w", sealed)
    with pytest.raises(AgentError, match="cannot be unsealed"):
        KeySealer(os.urandom(32)).unseal("v", sealed)
    with pytest.raises(AgentError, match="unknown format"):
        sealer.unseal("v", b"\x09" + sealed[1:])
    assert "hidden" in repr(sealer)
