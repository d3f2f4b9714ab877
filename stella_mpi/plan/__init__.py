"""``stellarun plan``: predictions of a cross-cluster route (step time, utilisation, WAN bytes,
time and cost to a target loss) before any GPU is rented. The top room: it may import every
other room of stella_mpi."""
