"""Exercise 10: speculative decoding's drafter (prompt lookup) and its acceptance rule, greedy and sampled."""
