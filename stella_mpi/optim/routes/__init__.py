"""The gradient routes: how one step's gradients cross between ranks and become an update.

Each is an object the optimizer (optim/distributed.py) holds as ``_route`` and calls at fixed
points: ``grad_ready(p)`` from backward's hook, ``launch(bucket)`` for a complete bucket,
``synchronize()`` before the update, ``update(closure)`` for the update itself, ``reset()``
after a checkpoint is loaded, ``describe()`` for the log. A route switch (the adjuster's) is
the optimizer installing another route object at a step boundary.

* :mod:`.sync`: Horovod's dense route (also the cluster's, under local steps), the sparse route
  and THC's, and the rank's own (local steps with ``inner="rank"``: nothing reduced);
* :mod:`.adasum`: Horovod's delta optimizer;
* :mod:`.cpu_engine`: the C optimizer on a CPU master copy (its own buckets and state).
"""
