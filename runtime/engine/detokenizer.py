"""Incremental detokenization and stop strings.

The engine appends each step's tokens to every sequence and decodes all their windows in one
`decode_batch` call (the tokenizer's Rust side runs them in parallel).

Decoding only a short window of recent tokens keeps each step O(1), and waiting while the window
ends in U+FFFD keeps multi-byte characters whole. Text that could still become a stop string is
held back from the stream until it is clear.
"""


class Detokenizer:
    def __init__(self, stop: list[str], include_stop: bool = False):
        self.stop, self.include_stop = stop, include_stop
        self.hold = max((len(s) - 1 for s in stop), default=0)  # tail that may still become a stop string
        self.ids: list[int] = []
        self.prefix_offset = self.read_offset = 0
        self.text = ""
        self.sent = 0  # characters of text already handed out

    def windows(self) -> list[list[int]]:
        """The two id windows whose decoded difference is the new text (decode many at once with decode_batch)."""
        return [self.ids[self.prefix_offset : self.read_offset], self.ids[self.prefix_offset :]]

    def consume(self, before: str, now: str, check_stop: bool = True) -> bool:
        """Take the decoded windows after an append; True if the text now contains a stop string (looked for only
        when `check_stop`: not before min_tokens). The text ends before it, or after it with `include_stop`."""
        if now == before:  # the new ids decode to nothing (skipped specials, ids the tokenizer lacks):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)  # keep the window short
            return False
        if len(now) <= len(before) or now.endswith("\ufffd"):
            return False
        checked_from = max(0, len(self.text) - self.hold)
        self.text += now[len(before) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        if not self.stop or not check_stop:
            return False
        hits = [(i, len(s)) for i, s in ((self.text.find(s, checked_from), s) for s in self.stop) if i >= 0]
        if hits:
            at, length = min(hits)
            self.text = self.text[: at + length * self.include_stop]
            return True
        return False

    def delta(self, finished: bool) -> str:
        """New text since the last call, minus a tail that may still turn into a stop string."""
        end = max(self.sent, len(self.text) - (0 if finished else self.hold))
        out, self.sent = self.text[self.sent : end], end
        return out
