"""How large the verbs transport makes its capsule buffers, without an RDMA device."""

import pytest

from dpu_wire.capsule import MAX_INLINE
from dpu_wire.transport.verbs import RECV_RING_BYTES, _slot_bytes, inline_within


@pytest.mark.parametrize(
    ("inline_max", "slot"), [(0, 256), (1, 256), (176, 256), (177, 257), (4096, 4176)]
)
def test_a_slot_holds_an_inline_submit_and_never_less_than_a_capsule(inline_max, slot):
    assert _slot_bytes(inline_max) == slot


@pytest.mark.parametrize("inline_max", [-1, MAX_INLINE + 1])
def test_inline_max_out_of_range_is_refused(inline_max):
    with pytest.raises(ValueError, match="inline_max must be"):
        _slot_bytes(inline_max)


@pytest.mark.parametrize("queue_depth", [1, 8, 32, 128, 256, 512, 1024])
@pytest.mark.parametrize("wanted", [0, 100, 4096, MAX_INLINE])
def test_the_recv_ring_stays_bounded_whatever_the_queue_depth(queue_depth, wanted):
    recv_depth = 2 * queue_depth + 8  # the agent link's default
    offered = inline_within(wanted, recv_depth)
    assert 0 <= offered <= wanted
    assert recv_depth * _slot_bytes(offered) <= max(RECV_RING_BYTES, recv_depth * 256)
    if recv_depth * _slot_bytes(wanted) <= RECV_RING_BYTES:
        assert offered == wanted  # what fits is offered as asked
    else:
        assert offered % 512 == 0 or offered == min(wanted, 176)


def test_4_kib_sources_go_inline_up_to_queue_depth_128():
    assert inline_within(4096, 2 * 128 + 8) == 4096
    assert inline_within(4096, 2 * 256 + 8) == 3584
    assert inline_within(4096, 2 * 1024 + 8) == 512
