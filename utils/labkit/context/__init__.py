"""Chapter 10: long sequences (context parallelism, ring attention, Ulysses, the fifth mesh axis).

The bench, formulas and reference pieces that are not graded answers live here; lab 10's
checkers live in `checks.py`."""
