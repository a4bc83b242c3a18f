"""Trace, cost and solve: the planning half of the compiler."""
