"""``hvd.DistributedOptimizer`` as a spec, routes and outer synchronizations.

* :mod:`.spec`: what the user asked for, one frozen spec, one table of refusals;
* :mod:`.routes`: the gradient routes (dense, sparse, THC, the cluster's, Adasum, CPU engine);
* :mod:`.outer_sync`: the outer synchronization (none, or local steps with a torch optimizer
  as the outer step), and :mod:`.outer_channel` for its overlapped exchange;
* :mod:`.tuning`: the composition of the two from the spec, and the adjuster's glue (density,
  bits, the mode switch, the automatic route);
* :mod:`.distributed`: the single subclass of the user's optimizer that holds them;
* shared: :mod:`.buckets` (names, plan, hooks, launch order), :mod:`.momentum_correction`,
  :mod:`.sparse_optim` (the CPU engine's C update rules), :mod:`.clusters`.

The top layer: imports everything below it."""
