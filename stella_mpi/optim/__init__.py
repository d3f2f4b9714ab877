"""The optimizers: ``hvd.DistributedOptimizer`` (:mod:`.factory`), one bucket module shared
by both of its optimizers (:mod:`.buckets`: names, plan, hooks, launch order), the synchronous
optimizer with Horovod's semantics (:mod:`.synchronous`), the CPU engine (:mod:`.cpu_engine`)
and its C update rules (:mod:`.sparse_optim`). The top layer: imports everything below it."""
