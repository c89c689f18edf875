"""Pacing: whether drafting pays for a request at its current context, from measured step times.

A drafted step costs more than a plain one (the draft's forward, then the verify rows' attention
and matrix work) and commits 1 + accepted tokens where a plain step commits one. Drafting pays
while

    gain = tokens per drafted step * seconds per plain step / seconds per drafted step >= 1

At short contexts it does; at thousands of positions each verify row's attention and the draft's
own attention over the context can cost more than the accepted tokens save. Step times depend on
the context and the machine, so they are kept per span of CONTEXT_SPAN positions for the whole
engine, from steps that ran alone (batch 1); tokens per drafted step depend on the text, so each
request keeps its own, starting from the engine's. Drafting pauses where the gain is measured below
LOSING, tries again for a few steps after a pause that doubles while it keeps losing, and while it
pays, one plain step now and then keeps the plain time current. Greedy output is unchanged: a
paused request verifies nothing, as a request with an empty draft does.

A step's tokens vary from 1 to n_max + 1, so a few steps say little: averages over ~3 steps of
each request alone paused drafting on open chat (where it pays 1.1-1.2x) for half the steps.
"""
from __future__ import annotations

from dataclasses import dataclass, field

# The least weight of a new sample in an average (the first 1 / FORGET weigh alike). Simulated on
# steps of 1-4 tokens with times within 10% (tests/engine/test_pacing.py), 0.05 paused drafting
# that paid 1.15x for 4% of the steps, 0.03 for none but the plain probes.
FORGET = 0.03
# Step times are kept per this many positions of context.
CONTEXT_SPAN = 512
# Samples an average needs before drafting may pause on it.
LEAST_SAMPLES = 8
# A request's tokens start from the engine's average as if from this many of its own steps: its own
# count once they hold up over about as many steps as an average remembers.
PRIOR_STEPS = 32
# Below this gain drafting pauses: a margin for what the averages still vary.
LOSING = 0.95
# While drafting pays, one plain step in this many (at a context span) keeps the plain time current.
PLAIN_EVERY = 64
# A pause's steps without drafting, the first time and at most (it doubles while drafting loses).
PAUSE, LONGEST_PAUSE = 8, 128
# Drafted steps after a pause before the gain is judged again: the first catches the draft up on
# the paused positions, the others measure.
TRIAL = 3


@dataclass
class Average:
    """The mean of the samples so far, until there are 1 / FORGET of them; then each new sample
    weighs FORGET."""
    value: float | None = None
    n: int = 0

    def add(self, sample: float) -> None:
        self.n += 1
        self.value = sample if self.value is None else self.value + max(FORGET, 1 / self.n) * (sample - self.value)


@dataclass
class StepTimes:
    """Seconds per step at one span of context, from steps that ran alone."""
    plain: Average = field(default_factory=Average)
    drafted: Average = field(default_factory=Average)  # the draft's forward included
    since_plain: int = 0  # drafted steps since the last plain one
    next_pause: int = PAUSE  # how long the next pause here lasts: it doubles while drafting loses


@dataclass
class Pacing:
    """One request's: its tokens per drafted step, and its pause."""
    tokens: Average
    pause: int = 0  # plain steps left in the current pause
    trial: int = 0  # drafted steps left after a pause before the gain is judged again


class Pacer:
    """Decides, per request and step, whether the request drafts. Engine thread only."""

    def __init__(self):
        self.times: dict[int, StepTimes] = {}
        self.tokens = Average()  # tokens per drafted step, every request's
        self._requests: dict[object, Pacing] = {}

    def forget(self, request) -> None:
        self._requests.pop(request, None)

    def _times(self, context: int) -> StepTimes:
        return self.times.setdefault(context // CONTEXT_SPAN, StepTimes())

    def _pacing(self, request) -> Pacing:
        if request not in self._requests:
            start = Average(self.tokens.value, PRIOR_STEPS) if self.tokens.value is not None else Average()
            self._requests[request] = Pacing(start)
        return self._requests[request]

    def gain(self, request, context: int) -> float | None:
        """Tokens per second drafting over tokens per second not, once all three are measured."""
        times, tokens = self._times(context), self._pacing(request).tokens
        if None in (times.plain.value, times.drafted.value, tokens.value):
            return None
        return tokens.value * times.plain.value / times.drafted.value

    def observe(self, request, context: int, seconds: float | None, drafted: bool, tokens: int) -> None:
        """A decode step of the request from `context` positions: its seconds (None: not its own,
        shared with other rows or with the draft's catch-up), whether it verified a draft, and the
        tokens it committed."""
        times = self._times(context)
        if drafted:
            self._pacing(request).tokens.add(tokens)
            self.tokens.add(tokens)
            if seconds is not None:
                times.drafted.add(seconds)
                times.since_plain += 1
        elif seconds is not None:
            times.plain.add(seconds)
            times.since_plain = 0

    def wants_draft(self, request, context: int, alone: bool) -> bool:
        """Whether the request drafts for its next step, from `context` positions; alone: whether
        it runs alone (only then does a plain step measure anything). Counts a pause and a trial down."""
        p = self._pacing(request)
        if p.pause:
            p.pause -= 1
            p.trial = 0 if p.pause else TRIAL
            return False
        if p.trial:
            p.trial -= 1
            return True
        times, gain = self._times(context), self.gain(request, context)
        if gain is not None and gain < LOSING and times.drafted.n >= LEAST_SAMPLES and p.tokens.n >= LEAST_SAMPLES:
            p.pause, times.next_pause = times.next_pause - 1, min(2 * times.next_pause, LONGEST_PAUSE)
            return False
        times.next_pause = PAUSE
        if not alone:
            return True
        # Drafting first (it usually pays); a plain step once the span's drafted steps are measured.
        wanted = LEAST_SAMPLES if times.plain.value is None else PLAIN_EVERY
        return times.since_plain < wanted
