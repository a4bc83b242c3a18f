"""Trace: a model file loaded and its model captured as an fx graph.

    model_file.py  the model file: build_model, example_inputs, loss_fn, ... (README.md, "Use")
    siblings.py    the modules of the model file's folder it imports (copied into the package)
    trace.py       the model as a flat fx graph (torch.fx, else torch.export)
    passes.py      graph passes: shapes propagated, the graph specialised to one microbatch
    autocast.py    autocast written inside the model, found while tracing and refused
    batch.py       sizes that follow the batch, kept as expressions of it ([Note: free batch])
    buffers.py     buffers kept as they were while the compile runs the model; BatchNorm's warning
    functions.py   custom autograd Functions kept as one call (their own backward)
    checkpointing.py  the user's torch.utils.checkpoint traced as the ops it runs, kept as recomputation
    kept.py        untraceable submodules kept whole
"""
