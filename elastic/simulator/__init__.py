"""The trace-driven cluster simulator: the same policy code as the portal, fed from a workload
trace instead of a database, on a modelled cluster. See `engine` for the rules of the game."""
