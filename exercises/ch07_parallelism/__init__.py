"""Exercise 7: tensor-parallel weight shards and MLP with one all-reduce, and the merge step of ring attention."""
