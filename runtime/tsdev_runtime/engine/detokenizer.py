"""Incremental detokenization and stop strings.

Each sequence decodes its tokens as they come with the tokenizer's own `DecodeStream`: one call into Rust per
token, which keeps the window of recent ids and holds back an incomplete multi-byte character (cheaper on the
host than building two id windows per sequence and decoding them all in one `decode_batch` each step; see
benchmarks/engine_overhead.py and docs/results.md). Ids the tokenizer lacks (the model's vocabulary may be
larger) decode to nothing. Text that could still become a stop string is held back from the stream until it is
clear.
"""
from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream


class Detokenizer:
    def __init__(self, tokenizer: Tokenizer, stop: list[str], include_stop: bool = False,
                 skip_special_tokens: bool = True):
        self.tokenizer, self.stream = tokenizer, DecodeStream(skip_special_tokens=skip_special_tokens)
        self.stop, self.include_stop = stop, include_stop
        self.hold = max((len(s) - 1 for s in stop), default=0)  # tail that may still become a stop string
        self.text = ""
        self.sent = 0  # characters of text already handed out

    def add(self, token: int, check_stop: bool = True) -> bool:
        """Decode one more token; True if the text now contains a stop string (looked for only when
        `check_stop`: not before min_tokens). The text ends before it, or after it with `include_stop`."""
        new = self.stream.step(self.tokenizer, token)
        if not new:
            return False
        checked_from = max(0, len(self.text) - self.hold)
        self.text += new
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
