"""The paged KV pool's bookkeeping, with a prefix cache over full pages.

A full page is identified by a hash chain over the tokens it and every page before it hold, so two
sequences that begin with the same tokens share those pages. Pages whose last user left stay cached
(evictable, least recently freed first) until the pool needs them or `flush()` forgets them.
"""
from collections import OrderedDict

from tsdev_runtime.engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool = True):
        self.num_pages, self.page_size = num_pages, page_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_pages
        self.page_hash: list[int | None] = [None] * num_pages
        self.hash_to_page: dict[int, int] = {}
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_pages))  # eviction order
        self.hits = self.queries = 0

    @property
    def num_free_pages(self) -> int:
        return len(self.free)

    @property
    def num_used_pages(self) -> int:
        return self.num_pages - len(self.free)

    def pages_needed(self, seq: Sequence, num_tokens: int) -> int:
        """New pages `seq` needs to hold `num_tokens` more tokens."""
        total = -(-(seq.num_computed_tokens + num_tokens) // self.page_size)
        return max(0, total - len(seq.pages))

    def match_prefix(self, seq: Sequence) -> None:
        """Attach the cached pages that hold a prefix of a new sequence's tokens.

        The last token is always recomputed: the step needs its hidden state to sample.
        """
        assert not seq.pages and seq.num_computed_tokens == 0
        if not self.enable_prefix_caching:
            return
        for start in range(0, len(seq) - self.page_size, self.page_size):
            h = self._chain(seq, start)
            page = self.hash_to_page.get(h)
            if page is None:
                break
            self._take(page)
            seq.pages.append(page)
            seq.page_hashes.append(h)
        seq.num_computed_tokens = seq.num_cached_tokens = len(seq.pages) * self.page_size

    def count_lookup(self, seq: Sequence) -> None:
        """Add an admitted sequence's prefix lookup to the hit rate (once per admission: a sequence that waits
        for pages is matched again each step)."""
        if self.enable_prefix_caching:
            candidates = len(range(0, len(seq) - self.page_size, self.page_size))  # the pages match_prefix may look up
            hits = seq.num_cached_tokens // self.page_size
            self.hits += hits
            self.queries += min(hits + 1, candidates)

    def allocate(self, seq: Sequence, num_tokens: int) -> bool:
        """Give `seq` the pages for `num_tokens` more tokens; False (and nothing taken) if the pool is short."""
        needed = self.pages_needed(seq, num_tokens)
        if needed > len(self.free):
            return False
        for _ in range(needed):
            page = next(iter(self.free))
            if self.page_hash[page] is not None:  # evict the least recently freed cached page
                del self.hash_to_page[self.page_hash[page]]
                self.page_hash[page] = None
            self._take(page)
            seq.pages.append(page)
        return True

    def commit_full_pages(self, seq: Sequence) -> None:
        """Register the pages that became full in the last step so later sequences can share them."""
        if not self.enable_prefix_caching:
            return
        for n in range(len(seq.page_hashes), seq.num_computed_tokens // self.page_size):
            h = self._chain(seq, n * self.page_size)
            seq.page_hashes.append(h)
            page = seq.pages[n]
            if h not in self.hash_to_page and self.page_hash[page] is None:
                self.hash_to_page[h] = page
                self.page_hash[page] = h

    def free_pages(self, seq: Sequence) -> None:
        # Release in reverse so a sequence's tail is evicted before its (more shareable) head.
        for page in reversed(seq.pages):
            self.ref_counts[page] -= 1
            if self.ref_counts[page] == 0:
                self.free[page] = None
        seq.pages, seq.page_hashes = [], []
        seq.num_computed_tokens = 0

    def flush(self) -> None:
        """Forget every cached prefix (e.g. after the model code changed)."""
        self.hash_to_page.clear()
        self.page_hash = [None] * self.num_pages

    def _chain(self, seq: Sequence, start: int) -> int:
        """Hash of the page starting at token `start`, chained to the hashes of the pages before it."""
        previous = seq.page_hashes[-1] if seq.page_hashes else None
        return hash((previous, tuple(seq.token_ids[start : start + self.page_size])))

    def _take(self, page: int) -> None:
        if self.ref_counts[page] == 0:
            del self.free[page]
        self.ref_counts[page] += 1
