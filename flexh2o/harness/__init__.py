"""flexh2o as a model of EleutherAI's lm-evaluation-harness (`python -m flexh2o.lm_eval`).

settings.py reads lm-eval's model_args; requests.py turns the harness's token-level requests into
what the engine runs (a prompt prefilled, tokens fed one at a time and scored) and checks them
before any weight loads; scoring.py and generation.py run them in length-sorted blocks on one
loaded engine; model.py is the harness's LM class over them.
"""
