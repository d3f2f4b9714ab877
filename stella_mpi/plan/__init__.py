"""The planner's room (the top layer): models of a job that run without MPI and without a
model, from the runtime's own functions. :mod:`.wire` says how many WAN bytes and messages
each rank's counters (``hvd.stats()["last_step"]``) record per step, for a layout of clusters,
a model's parameter sizes and a route."""
