"""The driver: the command line and the compile, above what they drive.

    cli.py           python -m partitioner compile | show | run
    compile.py       compile_model: the seven phases of one compile, in order
    phases.py        each phase as one call into partitioner.* or codegen
    search.py        --devices: phases 1-5 per candidate mesh, 6-7 for the best
    costs.py         node costs measured and cached, stages calibrated per plan
    package_info.py  what the package records beside the graph and the plan
    options.py       CompileOptions, their checks, the example batch cut into microbatches
    parallelize.py   partitioner.parallelize: a script's model compiled or reused, as a pipeline
    keywords.py      parallelize's keywords as CompileOptions, and its cache key
    recorded.py      the model file parallelize writes for a model built in a script
    prepared.py      what the phases hand each other (Source, Prepared, Compiled)

Floors: runtime < partitioner < codegen < driver; nothing below imports the driver.
"""
