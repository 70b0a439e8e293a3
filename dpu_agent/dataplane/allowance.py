"""A tenant's allowance of futile capsules: a token bucket the reactor keeps per tenant.

A futile capsule costs the agent work and runs no job: it is refused without a job
(data-plane spec section 2.5, rules 2, 3 and 5), or its job fails at admission (rule 6:
a bad span, no free queue slot, ...), or it CANCELs a job that is not open. The spec
has the agent answer each of them, and their answers are the expensive part (a FAILED
job is made, kept and published), so a host that sends them as fast as it can takes the
reactor's time from every other tenant, however each pass's budget is split. Past its
allowance a tenant's links are read no more until the allowance has refilled
(`RESUME_AT`): its capsules wait, in the kernel's socket buffer and then in the host
(TCP flow control) or in the host's send queue (verbs: no RECV is posted meanwhile).
None is dropped, and every one is answered once its turn comes.
"""

from __future__ import annotations

from typing import Final

# Futile capsules a paused tenant must have to spend again before its links are read:
# what it may cost the reactor in one go once it is past its allowance (a few refused
# SUBMITs, ~40 us each on this bed, against a pass of 64).
RESUME_AT: Final = 8


class Allowance:
    """Tokens for futile capsules: `rate` a second, at most `rate` (one second's) saved."""

    __slots__ = ("at", "rate", "resume", "tokens")

    def __init__(self, rate: float, now: float) -> None:
        if rate < RESUME_AT:
            raise ValueError(f"an allowance of {rate} a second is below {RESUME_AT}")
        self.rate = float(rate)
        self.tokens = self.rate
        self.at = now
        self.resume: object = None  # the timer that reads the tenant's links again

    def refill(self, now: float) -> float:
        """The tokens there are at `now` (monotonic seconds)."""
        if now > self.at:
            self.tokens = min(self.rate, self.tokens + (now - self.at) * self.rate)
            self.at = now
        return self.tokens

    def take(self, futile: int) -> None:
        """Spend `futile` capsules' tokens (the balance may go below 0: a pass's worth)."""
        self.tokens -= futile

    @property
    def spent(self) -> bool:
        """Whether the tenant must wait: less than one capsule's token left."""
        return self.tokens < 1

    def wait(self, now: float) -> float:
        """Seconds from `now` until `RESUME_AT` tokens are back."""
        return max(0.0, (RESUME_AT - self.refill(now)) / self.rate)

    def full(self, now: float) -> bool:
        """Whether a whole second's tokens are saved (the tenant sent nothing futile lately)."""
        return self.refill(now) >= self.rate

    def share(self, budget: int, now: float) -> int:
        """A pass's budget for the tenant: `budget`, or fewer when the tokens are lower."""
        return min(budget, max(1, int(self.refill(now))))
