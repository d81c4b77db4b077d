"""Plans: pure functions from a problem (rows, width, dtypes, pack width) and a device's
properties (shared memory, clusters, SMs, DRAM speed) to plain data, a ``Plan``: which kernel
template and arguments, threads, shared memory, cluster. No GPU, no arrays, no kernel sources.

``forward`` and ``backward`` hold the dense tiers, ``jagged`` the jagged batches' shapes,
``common`` the ``Plan`` record and the shape arithmetic they share.
"""
