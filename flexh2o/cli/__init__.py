"""What the `python -m flexh2o.*` commands run once their flags are parsed: a run or dataset job,
one rank of a torchrun world, and the memory probe that flexh2o.profile launches."""
