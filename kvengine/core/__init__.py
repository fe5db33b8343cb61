"""The running engine: the coordinator and its parts, memory, reservations."""
