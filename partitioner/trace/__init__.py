"""Trace: a model file loaded and its model captured as an fx graph.

    model_file.py  the model file: build_model, example_inputs, loss_fn, ... (README.md, "Use")
    trace.py       the model as a flat fx graph (torch.fx, else torch.export)
    passes.py      graph passes: shapes propagated, the graph specialised to one microbatch
"""
