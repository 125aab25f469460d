"""Exercise 7: tensor-parallel weight shards and MLP with one all-reduce, and the dispatch and combine of expert
parallelism."""
