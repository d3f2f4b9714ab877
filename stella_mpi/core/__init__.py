"""The core: process-wide state (:mod:`.state`), process sets (:mod:`.process_sets`), the
collective thread that runs every op after the ranks agree on it (:mod:`.collective_thread`),
the table of executors (:mod:`.executors`), the cross-cluster counters (:mod:`.counters`),
dtypes and fusion buffers.

Imports base, the C binding, compression and communication; never the API, the adjuster or
the optimizers.
"""
