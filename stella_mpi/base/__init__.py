"""The base layer: exception types and the settings read from the environment.

It imports nothing else of stella_mpi; every other room may import it."""
