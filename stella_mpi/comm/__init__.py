"""Communication: everything that moves bytes between ranks.

* :mod:`.deadline` - every wait on a peer, with ``STELLA_TIMEOUT``;
* :mod:`.buffers`, :mod:`.messages` - torch <-> MPI views, shard layout, JSON control messages;
* :mod:`.topology` - ranks, nodes, clusters and their communicators;
* :mod:`.intra` - the fast intra-cluster backends (MPI, gloo, NCCL);
* :mod:`.hierarchy` - the two-level route of one process set, with the dense cross-cluster step;
* :mod:`.sparse_exchange` - the compressed cross-cluster step;
* :mod:`.pacing` - user-space WAN pacing of the cross-cluster sends.

Imports the base layer, the C binding and compression; never the core, the API or the optimizers.
"""
