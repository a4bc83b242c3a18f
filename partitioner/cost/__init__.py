"""Cost: what each node and stage takes, and the hardware it is taken on.

    profile.py    annotate: every compute node's time, FLOPs and bytes, measured or analytic
    calibrate.py  node times made to add up to a whole graph's, and to each stage's as a rank runs it
    nodes.py      what the cost passes share about nodes: compute nodes, parameters, sizes
    roofline.py   the formulas: roofline time, messages, collectives, memory, MFU
    waves.py      tile and wave quantization: what a GPU's product of a given shape keeps busy
    costmodel.py  the solver's cost of a stage over a PartitionProblem's blocks
    hardware.py   Hardware profiles: built-in, from JSON, or this machine's (cached)
    measure.py    measuring this machine: the CPU's FLOP/s and bandwidth, gloo's links
    cache.py      the on-disk cache of measured profiles
"""
