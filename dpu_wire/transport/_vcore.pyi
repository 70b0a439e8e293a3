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
    def close(self) -> None: ...
