"""The conformance table: one row per requirement (MUST) of docs/data-plane.md.

Each row names the requirement's id, the transports it is checked on, and the check:
an async function of a `Ctx` that fails when a real agent (or, for a requirement on
the host, the SDK) does not do what the spec says. `make lint` runs
scripts/check_spec_rules.py, which fails when an id of the spec has no row here or a
row names an id the spec does not have.

Transports: BOTH rows run over tcp on the host (tests/conformance/test_conformance.py)
and over verbs in the soft-RoCE VM (tests/vm/test_conformance_verbs.py); TCP and VERBS
rows are about one transport only (the note says why when it is not obvious).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final, NamedTuple

from tests.conformance import checks_capsules as c2
from tests.conformance import checks_failure as c4
from tests.conformance import checks_inline as c28
from tests.conformance import checks_session as c1
from tests.conformance import checks_tcp as c3

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from tests.conformance.harness import Ctx

TCP: Final = frozenset({"tcp"})
VERBS: Final = frozenset({"verbs"})
BOTH: Final = TCP | VERBS


class Row(NamedTuple):
    rule: str
    transports: frozenset[str]
    check: Callable[[Ctx], Awaitable[None]]
    note: str = ""

    @property
    def last(self) -> bool:
        """Whether the row looks at the shutdown scenario, which stops the main agent."""
        return "shutdown scenario" in self.note


ROWS: Final = (
    # 1.1 OpenSession
    Row("DP-1.1-1", BOTH, c1.label_is_checked),
    Row("DP-1.1-2", BOTH, c1.endpoint_fields_are_checked, "each transport's own endpoint"),
    Row("DP-1.1-3", BOTH, c1.open_while_draining, "the shutdown scenario"),
    Row("DP-1.1-4", BOTH, c1.open_is_idempotent),
    Row("DP-1.1-5", BOTH, c1.transport_not_offered, "the agent offers only the run's transport"),
    Row("DP-1.1-6", BOTH, c1.endpoint_of_the_other_kind),
    Row("DP-1.1-7", BOTH, c1.endpoint_and_depth),
    Row("DP-1.1-8", BOTH, c1.limits, "short profile; per connection and per tenant"),
    Row("DP-1.1-9", BOTH, c1.failed_connect_leaves_nothing, "verbs: an address without ARP"),
    Row("DP-1.1-10", BOTH, c1.the_answer),
    # 1.2 verbs
    Row("DP-1.2-1", VERBS, c1.verbs_agent_endpoint),
    Row("DP-1.2-2", VERBS, c1.rts_before_the_answer),
    Row("DP-1.2-3", BOTH, c1.gid_must_be_unicast_ipv4, "a field check: a tcp agent answers it"),
    Row("DP-1.2-4", VERBS, c1.verbs_allow_is_honoured, "profile verbs_allow"),
    Row("DP-1.2-5", VERBS, c1.resolution_holds_up_nothing_else),
    Row("DP-1.2-6", VERBS, c1.unresolved_reads_the_same),
    # 1.3 tcp
    Row("DP-1.3-1", TCP, c1.dial_only_the_caller),
    Row("DP-1.3-2", TCP, c1.nothing_before_the_hello),
    Row("DP-1.3-3", TCP, c1.every_failure_reads_the_same),
    Row("DP-1.3-4", TCP, c1.agent_hello),
    Row("DP-1.3-5", TCP, c3.host_keeps_the_right_connection, "the SDK's host link"),
    Row("DP-1.3-6", TCP, c3.host_hello_before_the_answer, "the SDK's host link"),
    # 1.4 after the connection
    Row("DP-1.4-1", BOTH, c1.lease_metadata),
    Row("DP-1.4-2", BOTH, c4.sdk_holds_its_lease, "the SDK; short profile"),
    Row("DP-1.4-3", BOTH, c1.never_watched, "short profile"),
    Row("DP-1.4-4", BOTH, c1.orphaned, "short profile"),
    Row("DP-1.4-5", BOTH, c1.sixteen_streams),
    Row("DP-1.4-6", BOTH, c1.origin_filter),
    Row("DP-1.4-7", BOTH, c1.regions_all_or_none),
    Row("DP-1.4-8", BOTH, c1.regions_invalid),
    Row("DP-1.4-9", BOTH, c1.regions_per_session),
    Row("DP-1.4-10", BOTH, c1.withdraw_region),
    Row("DP-1.4-11", TCP, c1.addresses_are_names, "on verbs the NIC fixes addr and rkey"),
    Row("DP-1.4-12", BOTH, c1.volume_handles),
    Row("DP-1.4-13", BOTH, c1.key_handles),
    # 1.5 CloseSession
    Row("DP-1.5-1", BOTH, c1.close_cancels_and_answers),
    Row("DP-1.5-2", BOTH, c1.close_keeps_origins),
    Row("DP-1.5-3", BOTH, c1.close_ends_everything),
    # 2.1, 2.2 SUBMIT
    Row("DP-2.1-1", BOTH, c2.agent_job_ids),
    Row("DP-2.2-1", BOTH, c2.flags_and_reserved),
    Row("DP-2.2-2", BOTH, c2.unused_fields_are_zero),
    Row("DP-2.2-3", BOTH, c2.unused_spans_are_zero),
    Row("DP-2.2-4", BOTH, c2.used_spans),
    Row("DP-2.2-5", BOTH, c2.kind_checks),
    Row("DP-2.2-6", BOTH, c2.every_kind),
    Row("DP-2.2-7", BOTH, c2.volume_alignment),
    # 2.3 CANCEL
    Row("DP-2.3-1", BOTH, c2.cancel_of_nothing),
    Row("DP-2.3-2", BOTH, c2.cancel_now),
    # 2.4 COMPLETION
    Row("DP-2.4-1", BOTH, c2.completion_format),
    Row("DP-2.4-2", BOTH, c2.completion_times),
    Row("DP-2.4-3", BOTH, c2.completion_bytes),
    Row("DP-2.4-4", BOTH, c2.host_decoding, "the SDK"),
    # 2.5 answers
    Row("DP-2.5-1", BOTH, c2.in_order),
    Row("DP-2.5-2", BOTH, c2.one_answer_each),
    Row("DP-2.5-3", BOTH, c2.too_long),
    Row("DP-2.5-4", BOTH, c2.undecodable),
    Row("DP-2.5-5", BOTH, c2.completion_from_host),
    Row("DP-2.5-6", BOTH, c2.reserved_and_reused_ids),
    Row("DP-2.5-7", BOTH, c2.admission_order, "draining first: the shutdown scenario"),
    # 2.6 credits, ordering, deadlines
    Row("DP-2.6-1", BOTH, c2.queue_credits),
    Row("DP-2.6-2", BOTH, c2.slot_before_completion),
    Row("DP-2.6-3", BOTH, c2.data_before_completion),
    Row("DP-2.6-4", BOTH, c2.deadlines),
    Row("DP-2.6-5", TCP, c2.late_answers_touch_nothing, "only a tcp host can hold a READ back"),
    Row("DP-2.6-6", VERBS, c2.a_host_that_takes_no_completions, "tcp: DP-3-10"),
    # 2.7 compute kinds
    Row("DP-2.7-1", BOTH, c2.output_bounded),
    Row("DP-2.7-2", BOTH, c2.decrypt_tag, "the agent, and the SDK"),
    Row("DP-2.7-3", BOTH, c2.zstd_window),
    Row("DP-2.7-4", BOTH, c2.one_frame),
    # 2.8 inline sources
    Row("DP-2.8-1", BOTH, c28.runs_as_if_read, "verbs: no READ is seen by the host; see _reads"),
    Row("DP-2.8-2", BOTH, c28.length_must_match),
    Row("DP-2.8-3", BOTH, c28.bad_inline_sources),
    # 3 tcp frames
    Row("DP-3-1", TCP, c3.agent_frames),
    Row("DP-3-2", TCP, c3.host_violations),
    Row("DP-3-3", TCP, c3.answers_must_match),
    Row("DP-3-4", TCP, c3.answers_in_any_order),
    Row("DP-3-5", TCP, c3.host_checks_like_a_nic, "the SDK's host link"),
    Row("DP-3-6", TCP, c3.refusal_ends_the_data_plane),
    Row("DP-3-7", TCP, c3.unanswered_requests, "short profile"),
    Row("DP-3-8", TCP, c3.peer_closed),
    Row("DP-3-9", TCP, c3.unanswered_requests_bounded),
    Row("DP-3-10", TCP, c3.a_host_that_does_not_read),
    Row("DP-3-11", TCP, c3.frames_the_host_takes_none_of, "short profile"),
    # 4 failure
    Row("DP-4-1", BOTH, c4.failure_fails_jobs_and_session),
    Row("DP-4-2", BOTH, c4.failed_stays_listed, "main and short profiles"),
    Row("DP-4-3", BOTH, c4.failed_watch_streams),
    Row("DP-4-4", BOTH, c4.failed_takes_no_jobs),
    Row("DP-4-5", BOTH, c4.close_failed),
    Row("DP-4-6", TCP, c3.failed_before_the_close),
    # 5 shutdown
    Row("DP-5-1", BOTH, c4.no_new_work_while_draining, "the shutdown scenario"),
    Row("DP-5-2", BOTH, c4.open_jobs_may_finish, "the shutdown scenario"),
    Row("DP-5-3", BOTH, c4.then_cancelled, "the shutdown scenario"),
)


def rows_for(transport: str) -> list[Row]:
    """The rows checked over `transport`, those of the shutdown scenario last."""
    return sorted((row for row in ROWS if transport in row.transports), key=lambda row: row.last)
