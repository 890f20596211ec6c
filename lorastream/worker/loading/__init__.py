"""Tiered adapter loading: store -> host buffer -> device slot, off the decode path.

Read it in the order an adapter travels:

- ``manager.py``: :class:`AdapterManager`, the one owner of every adapter's state: references,
  placement, the step's slots, and the operator calls (load, unload, status);
- ``names.py``: the records (names -> content ids -> entries), the resolver, the store's catalogue;
- ``fetch.py``: into host memory: the host loader (reserve, fetch, check), the fetcher, the fetch
  process; ``fetch_child.py`` is that process's entry point (torch-free, starts fast);
- ``host.py``: the host tier: budget, arena, one adapter's buffer;
- ``landing.py``: where bytes land (torch-free layout and sink) and which layers have landed;
- ``adapter.py``: one adapter's record (:class:`AdapterEntry`), its checked weights, the plain
  values told to the rest of the worker;
- ``device_tier.py``: which adapter sits in which slot, copies into slots, the admission cost model;
- ``layered.py``: layer-ordered admission (``--layered-admission``, off by default).
"""
