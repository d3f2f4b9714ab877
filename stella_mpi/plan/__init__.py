"""The planner's room (the top layer): ``stellarun plan``'s jobs and the models they share.

:mod:`.wire` says how many WAN bytes and messages each rank's counters
(``hvd.stats()["last_step"]``) record per step, for a layout of clusters, a model's parameter
sizes and a route (pure: no MPI, no model run). :mod:`.kernel_costs`, :mod:`.memory` and
:mod:`.gpus` give the kernels' costs, a route's memory and GPU kinds' throughput;
:mod:`.calibrate` is the MPI job that measures the machine at hand, :mod:`.predict` predicts a
route on a layout with the adjuster's cost model, :mod:`.report` writes the plan. Run as
``python -m stella_mpi.plan check|calibrate|report`` (the launcher starts them)."""
