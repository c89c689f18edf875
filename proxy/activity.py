"""Recent finished requests, for the operator page's chart: what each server reported in the final
`timings` of a request the proxy relayed, kept in a ring buffer (the totals are proxy.metrics')."""
from __future__ import annotations

import time
from collections import deque
from dataclasses import asdict, dataclass

ACTIVITY_SIZE = 1000  # requests kept; GET /activity's limit is at most this


@dataclass(frozen=True)
class RequestRecord:
    time: float  # when the proxy saw it finish (Unix seconds)
    model: str
    prompt_n: int
    predicted_n: int
    prompt_per_second: float  # PP
    predicted_per_second: float  # TG
    draft_n: int
    draft_n_accepted: int


class Activity:
    def __init__(self, size: int = ACTIVITY_SIZE):
        self.records: deque[RequestRecord] = deque(maxlen=size)

    def record(self, model: str, timings: dict, now: float | None = None) -> None:
        try:
            entry = RequestRecord(
                time.time() if now is None else now, model, int(timings.get("prompt_n") or 0),
                int(timings.get("predicted_n") or 0), float(timings.get("prompt_per_second") or 0),
                float(timings.get("predicted_per_second") or 0), int(timings.get("draft_n") or 0),
                int(timings.get("draft_n_accepted") or 0))
        except (TypeError, ValueError, AttributeError):
            return  # a server that sends odd timings must not break the request
        self.records.append(entry)

    def recent(self, limit: int) -> list[dict]:
        """The last `limit` requests, oldest first."""
        return [asdict(r) for r in list(self.records)[-limit:]]
