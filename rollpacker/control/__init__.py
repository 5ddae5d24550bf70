"""How rank 0 reaches the engines that other ranks lead: the transport, the typed calls, the
engine server on each leader and rank 0's client of it."""
