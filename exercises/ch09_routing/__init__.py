"""Exercise 9: prefix-affinity routing with a load guard, over the engine's own prefix-cache block hashes."""
