"""Solve: the graph coarsened into blocks, posed as a partition problem, solved into a Plan.

    coarsen.py    the graph's nodes merged into at most MAX_BLOCKS blocks
    problem.py    a `Setting` (mesh, schedule, limits) and a coarsened graph posed as a PartitionProblem; the Plan of a solution
    intervals.py  dynamic programs over contiguous intervals of blocks (time, memory)
    solve.py      blocks to stages: a DP over intervals, and CP-SAT (OR-Tools, as tp/choose.py)
"""
