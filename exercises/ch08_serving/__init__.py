"""Exercise 8: stop strings over streamed text deltas, released as soon as they are safe and never taken back."""
