"""Exercise 4: a reference-counted KV block manager and attention through block tables."""
