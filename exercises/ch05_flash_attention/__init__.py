"""Exercise 5: the online softmax: partial attention, merging partials, tiled attention."""
