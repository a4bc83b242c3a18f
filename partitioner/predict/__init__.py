"""Predict: a plan's training step simulated, and the manifest's `predicted` block.

    simulate.py  the schedule walked with each stage's compute and each message's cost
    predict.py   the step time, MFU and per-stage memory of a plan on a hardware profile
    step.py      the predicted step as one function of inputs the manifest keeps
    timeline.py  the predicted (or a measured) step drawn, ranks x time
"""
