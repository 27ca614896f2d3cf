"""Whether a schedule's decode steps keep every weight and cache slot where it is computed on (a
table whose rows are looked up, an embedding, aside: no load moves it), so that a step can run
every layer back to back (schedule.whole_token): as CUDA graphs (decode_graphs.py) or, on the
CPU, with runs of layers in one C call (cpu_decode.py).
"""


def why_not(schedule) -> str | None:
    """Why a decode step moves something (None: nothing moves)."""
    if schedule.act_tier != "gpu":
        return "activations leave the compute device"
    for layer in schedule.layers:
        if not layer.weights_in_place:
            return "weights are loaded anew each step (streamed, or compressed)"
        for home in getattr(layer, "homes", ()):
            if any(not part.in_place(prefill=False) or part.cpu_attends for part in home.parts):
                return "the KV cache is streamed"
    return None
