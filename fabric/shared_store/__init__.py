"""The shared store: one chunk store per host that outlives engines.

:mod:`fabric.shared_store.service` (``fabric store serve``) is an application
on top of the transfer layer: a :class:`~fabric.store.tier.TieredStore`
served over a transfer node's control channel and data plane, which engines
attach to, push chunks into and fetch prefixes from.
"""
