"""Generation: Engine (load a model onto the tiers, generate), the Policy that shapes a run, the
zig-zag schedule, the batch's sequences and sampling, CUDA graphs of decode steps, pipeline
stages, and the pre-flight that checks a run fits before anything is allocated."""
