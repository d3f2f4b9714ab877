"""``stellarun``: the launcher of stella_mpi jobs (cluster labels for mpirun, host files, and
the WAN emulation for runs on one machine). A package of its own: it never imports stella_mpi
(nor torch or MPI), and ``import stella_mpi`` never loads it.

* :mod:`.cli` - the command line and the mpirun command it builds;
* :mod:`.wan` - network namespaces joined by shaped links, and their clean-up;
* :mod:`.tunlink` - the user-space delaying forwarder between TUN devices (``--wan-delay``);
* :mod:`.shaping` - rates, delays, schedules and the shaping constants they share.
"""
