"""The scheduler's encoder cache: which items' encoder outputs the workers hold, within a budget of embedding rows.

A vision-language request's images are encoded once per item hash (:mod:`weft.contracts.mm_processor`), by the
workers (``ModelFamily.encode``), when a step first needs rows of an item: its scheduled positions cover part of
the item's placeholder ranges. The workers keep each output until the scheduler tells them to drop it
(``SchedulerOutput.freed_encoder_hashes``); this module is the scheduler's ledger of what they hold, as vLLM's
encoder-cache manager is:

* an entry is *referenced* by every request whose next positions still need its rows (its ranges are not all
  computed), and is kept while it is;
* an unreferenced entry stays held (a later request with the same image takes it without encoding: a hit) until
  room is needed for another item; the least recently released goes first, and its hash is sent to the workers
  with the next step;
* the budget counts embedding rows (one per placeholder position), ``engine.encoder_cache_size``. An item larger
  than the whole budget can never be encoded: :meth:`EncoderCache.refusal` says so when the request arrives.

:meth:`EncoderCache.plan` is what a step asks for one request: given the positions it is about to compute, which
items need encoding now, and how many of those positions it may compute when some item does not fit (it stops
before the item; the running requests' references free room as they move past their items). A step's frees are
applied by the workers before its encodings, and steps run in order, so an output freed in step N+1 was still
there for step N's forward.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:
    from weft.contracts.mm_processor import MultimodalInputs
    from weft.engine.core.request import Request


class EncoderCacheStats(msgspec.Struct):
    """Counters since start: items a step needed (looked up once per request, after each (re)scheduling) and those
    found held."""

    queries: int = 0
    hits: int = 0


class EncoderCache:
    """What the workers' encoder caches hold, by item hash (module docstring)."""

    def __init__(self, budget: int, reads_images: bool = True, architecture: str = "") -> None:
        """``reads_images``: whether the model family encodes images (``WorkerInfo.reads_images``); a request
        carrying images is refused otherwise (:meth:`refusal`), ``architecture`` named in the message."""
        if budget < 1:
            raise ValueError(f"engine.encoder_cache_size must be at least 1 embedding row, got {budget}")
        self.budget = budget
        self.reads_images = reads_images
        self.architecture = architecture
        self._rows: dict[str, int] = {}
        """Held entries: item hash -> its rows."""
        self._references: dict[str, set[str]] = {}
        """Held entries some request still needs: item hash -> those requests."""
        self._idle: OrderedDict[str, None] = OrderedDict()
        """Held entries no request needs, least recently released first: evicted in this order."""
        self._used = 0
        self._freed: list[str] = []
        """Hashes evicted since the last step was built: the workers drop them."""
        self._looked_up: dict[str, set[str]] = {}
        """Per request, the hashes already counted in :attr:`stats` since it was (re)scheduled."""
        self.stats = EncoderCacheStats()

    def refusal(self, multimodal: MultimodalInputs) -> str | None:
        """Why a request with these items can never run here (the family encodes no images, or an item is larger
        than the budget); None: it can."""
        if multimodal.items and not self.reads_images:
            return (
                f"this model ({self.architecture or 'its architecture'}) has a multimodal processor but its model "
                f"family has no vision encoder (ModelFamily.encode), so its images cannot be read; send text parts "
                f"only, or serve it with a family that encodes images"
            )
        for index, item in enumerate(multimodal.items):
            if item.num_embeddings > self.budget:
                return (
                    f"image {index} of the prompt needs {item.num_embeddings} embedding rows, more than the encoder "
                    f"cache holds (engine.encoder_cache_size = {self.budget}); send a smaller image or raise "
                    f"engine.encoder_cache_size"
                )
        return None

    def holds(self, item_hash: str) -> bool:
        return item_hash in self._rows

    def plan(self, request_id: str, multimodal: MultimodalInputs, start: int, count: int) -> tuple[int, list[int]]:
        """For a request about to compute positions ``start..start+count-1``: how many of them it may compute, and
        the indices of its items to encode in this step (now counted as held). Items that earlier steps computed
        past are released.

        An item not held is taken in when it fits (evicting idle entries); otherwise the request stops before that
        item's first position (0 tokens when it starts inside it)."""
        # Released only once computed by an earlier step: a step's evictions reach the workers with the step after
        # it, and this step's forward may still read the rows of an item it finishes.
        self._release_passed(request_id, multimodal, start)
        end = start + count
        to_encode: list[int] = []
        looked_up = self._looked_up.setdefault(request_id, set())
        for span_start, span_end, index, _ in multimodal.spans():
            if span_end <= start or span_start >= end:
                continue
            item = multimodal.items[index]
            first_look = item.hash not in looked_up
            if first_look:
                looked_up.add(item.hash)
                self.stats.queries += 1
            if item.hash in self._rows:
                self.stats.hits += first_look and index not in to_encode
                self._reference(item.hash, request_id)
                continue
            if not self._make_room(item.num_embeddings):
                end = max(min(end, span_start), start)
                break
            self._rows[item.hash] = item.num_embeddings
            self._used += item.num_embeddings
            self._reference(item.hash, request_id)
            to_encode.append(index)
        return end - start, to_encode

    def plan_step(self, scheduled: dict[str, tuple[Request, int]], planned: dict[str, int]) -> dict[str, list[int]]:
        """The items each scheduled request with images needs encoded in this step (:meth:`plan`; ``scheduled``: each
        request and its token count, ``planned``: where its step starts); a request whose next item does not fit
        the cache computes only up to it (its count cut in ``scheduled``), or is left out of the step."""
        encoder_inputs: dict[str, list[int]] = {}
        for request_id, (request, count) in list(scheduled.items()):
            if request.multimodal is None:
                continue
            fits, to_encode = self.plan(request_id, request.multimodal, planned[request_id], count)
            if fits == 0:
                del scheduled[request_id]
            elif fits < count:
                scheduled[request_id] = (request, fits)
            if to_encode and fits:
                encoder_inputs[request_id] = to_encode
        return encoder_inputs

    def release(self, request_id: str) -> None:
        """The request ended or was preempted: it needs none of its entries (they stay held, idle)."""
        self._looked_up.pop(request_id, None)
        for item_hash in [item_hash for item_hash, users in self._references.items() if request_id in users]:
            self._unreference(item_hash, request_id)

    def take_freed(self) -> list[str]:
        """Hashes evicted since the last call: the next step's ``freed_encoder_hashes``."""
        freed, self._freed = self._freed, []
        return freed

    def reset(self) -> None:
        """Forget every entry (a failed step: the workers may not hold what it was to encode); they are all freed."""
        self._freed.extend(self._rows)
        self._rows.clear()
        self._references.clear()
        self._idle.clear()
        self._looked_up.clear()
        self._used = 0

    def _release_passed(self, request_id: str, multimodal: MultimodalInputs, computed: int) -> None:
        """Release the items whose every range lies before ``computed``: the request needs none of their rows again."""
        last_end: dict[int, int] = {}
        for _, span_end, index, _ in multimodal.spans():
            last_end[index] = max(last_end.get(index, 0), span_end)
        for index, span_end in last_end.items():
            item_hash = multimodal.items[index].hash
            if span_end <= computed and request_id in self._references.get(item_hash, ()):
                self._unreference(item_hash, request_id)

    def _reference(self, item_hash: str, request_id: str) -> None:
        self._idle.pop(item_hash, None)
        self._references.setdefault(item_hash, set()).add(request_id)

    def _unreference(self, item_hash: str, request_id: str) -> None:
        users = self._references[item_hash]
        users.discard(request_id)
        if not users:
            del self._references[item_hash]
            self._idle[item_hash] = None

    def _make_room(self, rows: int) -> bool:
        """Evict idle entries until ``rows`` more fit; False (evicting nothing) when they cannot."""
        idle_rows = sum(self._rows[item_hash] for item_hash in self._idle)
        if self._used - idle_rows + rows > self.budget:
            return False
        while self._used + rows > self.budget:
            item_hash, _ = self._idle.popitem(last=False)
            self._used -= self._rows.pop(item_hash)
            self._freed.append(item_hash)
        return True
