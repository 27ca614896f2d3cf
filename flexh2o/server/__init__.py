"""flexh2o behind OpenAI's HTTP API: `python -m flexh2o.serve` (serve.py).

One engine loop, on the thread that loaded the model, runs every request through one pool of
refilled slots (engine_loop.py): the choices of online completions and chat requests, and the
records of the Batch API's batches, which the dataset-job machinery reads, checks and writes
(batches.py). The HTTP side is a
Starlette app served by uvicorn (app.py, routes.py); it parses OpenAI's request bodies with the
job's own checks (openai_requests.py), answers in OpenAI's shapes (responses.py), streams text as
it comes (text.py, streams.py), guards access (access.py) and counts what it does (metrics.py).
"""
