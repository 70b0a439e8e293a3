# Types of the compiled core (_vcore.c); see native.py.

from typing import Final

ABI: Final[int]

class Qp:
    def __init__(
        self,
        qp: int,
        qp_num: int,
        send_cq: int,
        recv_cq: int,
        recv_addr: int,
        recv_slot: int,
        recv_depth: int,
        recv_lkey: int,
    ) -> None: ...
    def send_copy(
        self,
        wr_id: int,
        addr: int,
        room: int,
        lkey: int,
        head: bytes | memoryview,
        tail: bytes | memoryview | None,
        /,
    ) -> int: ...
    def post_rdma(
        self,
        wr_id: int,
        read: bool,
        addr: int,
        length: int,
        lkey: int,
        remote_addr: int,
        rkey: int,
        signaled: bool,
        /,
    ) -> int: ...
    def post_chain(
        self,
        write_id: int,
        addr: int,
        length: int,
        lkey: int,
        remote_addr: int,
        rkey: int,
        send_id: int,
        send_addr: int,
        send_length: int,
        send_lkey: int,
        /,
    ) -> int: ...
    def post_recv(self, slot: int, /) -> int: ...
    def poll_send(self) -> tuple[int, int] | None: ...
    def poll_recv(self) -> tuple[int, int, int] | None: ...
    def spin_recv(self, timeout_ns: int, /) -> tuple[int, int, int] | None: ...
    def wait_any(self, timeout_ns: int, /) -> bool: ...
    def call(
        self,
        wr_id: int,
        addr: int,
        room: int,
        lkey: int,
        head: bytes | memoryview,
        tail: bytes | memoryview | None,
        job_id: int,
        timeout_ns: int,
        /,
    ) -> tuple[int, int, int, int, int, int, int, int, int, str] | None: ...
    def fast_setup(
        self, addr: int, lkey: int, slot_bytes: int, slots: int, inline_max: int, /
    ) -> None: ...
    def set_regions(self, regions: list[tuple[int, int, int, int]], /) -> None: ...
    def read_setup(
        self,
        addr: int,
        lkey: int,
        slot_bytes: int,
        slots: int,
        max_bytes: int,
        default_deadline_ms: int,
        /,
    ) -> None: ...
    def serve(
        self, budget: int, next_wr_id: int, room: int, job_room: int, /
    ) -> tuple[
        int,
        list[tuple[int, ...]],
        list[tuple[int, ...]],
        tuple[int, int, int] | None,
        int,
        int,
    ]: ...
    def core_cancel(self, job_id: int, /) -> bool: ...
    def take_done(self) -> list[tuple[int, int, int]] | None: ...
    def close(self) -> None: ...
    @property
    def recv_errno(self) -> int: ...
    @property
    def core_busy(self) -> int: ...
    @property
    def core_wrs(self) -> int: ...
    @property
    def core_answered(self) -> int: ...
