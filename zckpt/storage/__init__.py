"""Where bytes live and how they get there: one ``Storage`` per operation (``session``) with its object
stores (``objstore``: clients, caches, errors, retries, credentials) and open local files (``fileio``),
the threads that carry it (``threads``), and publishing: ``sink`` (the one file writer, hashing and
``O_DIRECT``), ``staging`` (local outputs: stage, fsync, rename/exchange) and ``remote_staging``
(object-store outputs: data first, the completing object last, generations for replacements; see
docs/object-storage.md), ``interrupts``, and the integrity primitives the writers and readers share
(``digest``, ``scan``, ``checks``). It knows no checkpoint format.
"""
