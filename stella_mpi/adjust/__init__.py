"""The bandwidth-driven adjuster: the user's settings (:mod:`.settings`, ``hvd.Adjuster``), the
pure cost model and decisions (:mod:`.controller`), and the per-optimizer session that times
steps, gathers telemetry over MPI and applies decisions at the same step everywhere
(:mod:`.session`). Imported by the optimizers; imports the API, the core and below."""
