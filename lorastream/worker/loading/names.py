"""Names to content ids on the request path: the adapter manager's resolver.

A request names ``name`` (the store's current version) or ``name@<content-id prefix>`` (one
version). The resolver answers from, in order:

1. a local registration (LoadAdapter from a path) under that name;
2. the store's catalogue (``catalogue.py``) when it is live: the name's content id, then the
   entry this worker holds for it: no store call for a resident adapter. A content id this worker
   does not hold yet costs one DescribeAdapter (its manifest), as a cold adapter's fetch will;
3. when the store is down: the entry this worker last resolved the name to (resident adapters
   keep serving), or a clear error for the others;
4. otherwise (catalogue syncing): DescribeAdapter, falling back to the held entry when the store
   cannot be reached.

When the catalogue reports that a name moved to other content, this worker's mapping of the name
to the old content is dropped, and a pin held through it moves to the name's next content.
``name@prefix`` mappings stay: a version's content never changes.
"""

from __future__ import annotations

import logging
import time

from lorastream.core.errors import AdapterNotFound, SourceUnavailable
from lorastream.core.versions import parse_ref, pinned_ref
from lorastream.worker.loading.adapter_weights import check_fits
from lorastream.worker.loading.catalogue import CatalogueState, StoreCatalogue
from lorastream.worker.loading.entry import AdapterEntry
from lorastream.worker.loading.fetcher import AdapterFetcher
from lorastream.worker.loading.records import AdapterRecords
from lorastream.worker.model.config import ModelConfig

log = logging.getLogger(__name__)


class NameResolver:
    """Resolves references to the entries of the manager's :class:`AdapterRecords`."""

    def __init__(
        self, records: AdapterRecords, fetcher: AdapterFetcher, config: ModelConfig,
        max_rank: int,
    ) -> None:
        self._records = records
        self._fetcher = fetcher
        self._config = config
        self._max_rank = max_rank
        client = fetcher.client
        self.catalogue = StoreCatalogue(client, self.forget) if client is not None else None
        if self.catalogue is not None:
            self.catalogue.start()

    def close(self) -> None:
        if self.catalogue is not None:
            self.catalogue.close()

    def resolve(self, ref: str) -> AdapterEntry:
        """The entry ``ref`` stands for (see the module docstring for where the answer comes
        from). Raises AdapterNotFound, SourceUnavailable (store down, adapter not held here) and
        the store's errors."""
        known = self._records.named(ref)
        if known is not None and known.local_path is not None:
            return known
        if self.catalogue is None:
            if known is not None:
                return known
            raise AdapterNotFound(
                f"unknown model {ref!r}: not the base model and not an adapter loaded on this "
                "worker (the worker has no --store to look it up)"
            )
        lookup = self.catalogue.lookup(ref)
        if lookup.state is CatalogueState.DOWN:
            if known is not None:
                return known
            try:  # the store may be back before the watch is: one try, failing fast
                return self._describe(ref, ref)
            except SourceUnavailable as err:
                since = time.strftime("%H:%M:%S", time.gmtime(lookup.down_since))
                raise SourceUnavailable(
                    f"adapter {ref} is not held on this worker and the adapter store has been "
                    f"unreachable since {since} UTC: adapters in this worker's memory keep "
                    "serving, others fail until the store is back"
                ) from err
        if lookup.state is CatalogueState.LIVE:
            if lookup.adapter_id is not None:
                entry = self._records.bind(ref, lookup.adapter_id)
                if entry is not None:
                    return entry
                return self._describe(ref, pinned_ref(ref, lookup.adapter_id))
            if not parse_ref(ref).pinned:
                raise AdapterNotFound(
                    f"unknown model {ref!r}: not the base model and not an adapter in the store "
                    "('lorastream adapters ls' lists them)"
                )
            if known is not None:  # an older version resolved before: its content is fixed
                return known
        try:
            return self._describe(ref, ref)
        except SourceUnavailable:
            if known is None:
                raise
            log.warning("store unreachable; serving %s from this worker's copy", ref)
            return known

    def forget(self, name: str, adapter_id: str | None) -> None:
        """The store's ``name`` now points at ``adapter_id`` (None: deleted). When it moved to
        other content, drop this worker's mapping of ``name`` to the old one (unless a local
        registration); a pin held only through it waits for the name's next content. A deleted
        name keeps its mapping: requests for it are refused while the catalogue is live, and an
        operator can still unload what this worker holds under it."""
        if adapter_id is not None:
            self._records.unbind_moved(name, adapter_id)

    def _describe(self, ref: str, query: str) -> AdapterEntry:
        """Ask the store for ``query``'s manifest; the entry ``ref`` now maps to."""
        manifest = self._fetcher.describe(query)
        check_fits(manifest, self._config, self._max_rank)
        return self._records.add(ref, manifest)
