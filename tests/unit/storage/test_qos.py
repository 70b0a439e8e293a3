"""Per-volume QoS: token buckets that return a wait (never refuse), limits checked and kept."""

import pytest

from dpu_agent.errors import InvalidArgument, NotFound
from dpu_agent.storage import DataServices, FileVolumeStore, QosLimits
from dpu_agent.storage.qos import MAX_BYTES_PER_SECOND, MIN_BYTES_PER_SECOND, VolumeQos

from .conftest import MiB


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_bucket_lets_a_burst_through_then_spaces_the_rest():
    clock = Clock()
    qos = VolumeQos(QosLimits(write_iops=10), clock)
    waits = [qos.throttle("write", 4096).wait for _ in range(14)]
    assert waits[:10] == [0.0] * 10  # one second's worth at once
    assert waits[10:] == pytest.approx([0.1, 0.2, 0.3, 0.4])  # then 10 per second, in order
    clock.now += 1.0  # a second later the debt (0.4 s) is paid and 6 tokens are back
    assert [qos.throttle("write", 4096).wait for _ in range(7)][-2:] == pytest.approx([0.0, 0.1])
    assert qos.throttle("read", 1 << 30).wait == 0.0  # reads are not limited
    assert qos.throttled_ops == 5
    assert qos.delay_us == pytest.approx(1_100_000, abs=10)


def test_the_longest_wait_of_ops_and_bytes_counts():
    clock = Clock()
    qos = VolumeQos(QosLimits(read_iops=1000, read_bytes_per_second=MiB), clock)
    assert qos.throttle("read", MiB).wait == 0.0
    assert qos.throttle("read", MiB // 2).wait == pytest.approx(0.5)
    assert qos.throttle("read", 8 * MiB).wait == pytest.approx(
        8.5
    )  # larger than a burst: waits longer


def test_reservations_given_back_leave_no_debt_but_what_they_waited_for():
    """An I/O that will not be done (its job ended while it waited) gives back the tokens
    it had yet to wait for; what it waited for, or took from the burst, stays spent."""
    clock = Clock()
    qos = VolumeQos(QosLimits(write_iops=10), clock)
    burst = [qos.throttle("write", 4096) for _ in range(10)]
    waiting = [qos.throttle("write", 4096) for _ in range(4)]
    assert [r.wait for r in waiting] == pytest.approx([0.1, 0.2, 0.3, 0.4])
    for reservation in burst:
        reservation.give_back()  # it never waited: the burst stays spent
    for reservation in waiting[1:]:
        reservation.give_back()
    waiting[-1].give_back()  # once only
    second = qos.throttle("write", 4096)
    assert second.wait == pytest.approx(0.2)  # behind the one left, as if the 3 never were
    clock.now += 0.15  # `second` has 0.05 s of its turn (0.1 to 0.2 s) left: half a token
    second.give_back()
    assert qos.throttle("write", 4096).wait == pytest.approx(0.1)  # not 0.15, nor 0.05


def test_a_give_back_after_new_limits_changes_nothing():
    clock = Clock()
    qos = VolumeQos(QosLimits(write_iops=1), clock)
    qos.throttle("write", 1)
    waiting = qos.throttle("write", 1)
    qos.set(QosLimits(write_iops=1))  # buckets start full
    waiting.give_back()  # to the old bucket: the new one gains nothing
    qos.throttle("write", 1)
    assert qos.throttle("write", 1).wait == pytest.approx(1.0)


def test_new_limits_start_full():
    clock = Clock()
    qos = VolumeQos(QosLimits(write_iops=1), clock)
    qos.throttle("write", 1)
    assert qos.throttle("write", 1).wait == pytest.approx(1.0)
    qos.set(QosLimits())
    assert qos.throttle("write", 1).wait == 0.0


@pytest.mark.parametrize(
    ("qos", "message"),
    [
        (QosLimits(read_iops=-1), r"qos.read_iops -1 is out of range: 0 \(no limit\) or 1"),
        (QosLimits(write_iops=10**8), "qos.write_iops 100000000 is out of range"),
        (QosLimits(read_bytes_per_second=MIN_BYTES_PER_SECOND - 1), "read_bytes_per_second"),
        (QosLimits(write_bytes_per_second=MAX_BYTES_PER_SECOND + 1), "write_bytes_per_second"),
        (QosLimits(read_iops=True), "qos.read_iops must be an integer"),
    ],
)
def test_limits_out_of_range_are_refused_and_change_nothing(store, qos, message):
    with pytest.raises(InvalidArgument, match=message):
        store.create("v", MiB, 4096, DataServices(), qos=qos)
    assert store.list() == []
    store.create("v", MiB, 4096, DataServices(), qos=QosLimits(read_iops=5))
    with pytest.raises(InvalidArgument, match=message):
        store.set_qos("v", qos)
    assert store.get("v").qos == QosLimits(read_iops=5)


def test_the_store_throttles_and_counts(store):
    limits = QosLimits(write_iops=2, read_bytes_per_second=MIN_BYTES_PER_SECOND)
    info = store.create("v", MiB, 4096, DataServices(), qos=limits)
    assert info.qos == limits
    assert store.throttle("v", "write", 4096).wait == 0.0
    assert store.throttle("v", "write", 4096).wait == 0.0
    assert store.throttle("v", "write", 4096).wait > 0.4
    assert store.throttle("v", "read", 4 * MIN_BYTES_PER_SECOND).wait > 2.5
    assert store.throttle("nope", "write", 4096).wait == 0.0  # the I/O will say NOT_FOUND
    with pytest.raises(InvalidArgument, match="op must be one of read, write"):
        store.throttle("v", "trim", 4096)
    stats = store.stats("v")
    assert stats.throttled_ops == 2
    assert stats.throttle_delay_us > 2_900_000
    changed = store.set_qos("v", QosLimits())
    assert changed.qos == QosLimits()
    assert changed.update_ns >= info.update_ns
    assert store.throttle("v", "write", 4096).wait == 0.0
    with pytest.raises(NotFound):
        store.set_qos("nope", limits)


def test_limits_survive_a_restart(tmp_path):
    limits = QosLimits(1, 2, MIN_BYTES_PER_SECOND, 2 * MIN_BYTES_PER_SECOND)
    with FileVolumeStore(tmp_path) as store:
        store.create("a", MiB, 4096, DataServices(), qos=limits)
        store.create("b", MiB, 4096, DataServices())
        store.set_qos("b", QosLimits(write_iops=7))
    with FileVolumeStore(tmp_path) as store:
        assert store.get("a").qos == limits
        assert store.get("b").qos == QosLimits(write_iops=7)
        store.throttle("b", "write", 1)
        assert store.throttle("b", "write", 1).wait == 0.0  # full buckets after a restart
