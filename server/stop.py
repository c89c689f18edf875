"""Stop strings matched across token boundaries: text that may begin a stop string is held back
until it is known not to, and a stop string itself is never emitted."""
from __future__ import annotations


class StopMatcher:
    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.held = ""  # text received but not yet released
        self.stopped = False

    def push(self, text: str) -> str:
        """Feed a text delta; returns the text that can be released now. After a stop string is
        found, `stopped` is True and everything from the stop string on is dropped."""
        if self.stopped:
            return ""
        if not self.stops:
            return text
        buf = self.held + text
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped, self.held = True, ""
            return buf[:min(hits)]
        keep = self._partial_suffix(buf)
        self.held = buf[len(buf) - keep:] if keep else ""
        return buf[:len(buf) - keep]

    def flush(self) -> str:
        """At the end of generation, held text that never became a stop string is released."""
        out, self.held = ("" if self.stopped else self.held), ""
        return out

    def _partial_suffix(self, buf: str) -> int:
        """Length of the longest suffix of buf that is a proper prefix of some stop string."""
        best = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(buf)), best, -1):
                if buf.endswith(s[:n]):
                    best = n
                    break
        return best
