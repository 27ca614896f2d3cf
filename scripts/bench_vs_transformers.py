"""flexh2o against Hugging Face transformers' generate: same weights, dtype and threads, one process.

    python scripts/bench_vs_transformers.py     # SmolLM2-135M (GGUF) and opt-125m, batches 1, 8, 32, 256 + 64
    python scripts/bench_vs_transformers.py --models opt-350m --batches 8 --gen-len 32

A model is `smollm2` (SmolLM2-135M-Instruct from models/, the GGUF `make setup` fetches, read by
both engines from the same file) or an OPT preset (identical dummy weights in both). Each engine
runs with everything on the compute device, as transformers does, in the CPU's compute dtype.
For every (model, batch) the two engines alternate, the first one swapped each run, after one
warm-up each. Prefill is the time to the first new token, decode the rest; total is the wall time
of the whole generate call. Figures are medians of --runs; the machine's load average and the
share of the CPU other processes took are written beside each block (a busy machine slows
both engines, but not alike: only ratios from a quiet block are worth comparing).
Writes results/vs_transformers.{json,md}.
"""

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from flexh2o import Engine, Policy  # noqa: E402
from flexh2o.host.cpu_load import LoadMeter  # noqa: E402
from flexh2o.host.machine import cpu_compute_dtype, describe_machine  # noqa: E402
from flexh2o.models.opt import PRESETS  # noqa: E402
from flexh2o.common.output_files import write_results  # noqa: E402
from flexh2o.runs.prompts import synthetic_prompts  # noqa: E402
from flexh2o.checkpoints.weights import DummyWeights  # noqa: E402

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
SMOLLM2 = os.path.join(REPO, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")
ENGINES = ("transformers", "flexh2o")


class FirstTokenClock:
    """A generate() streamer that notes when the prompt goes in and when each token comes out."""

    def __init__(self):
        self.times = []

    def put(self, value):
        self.times.append(time.perf_counter())

    def end(self):
        self.times.append(time.perf_counter())


def opt_model(spec, seed, dtype):
    """transformers' OPT with flexh2o's dummy weights for the same preset."""
    from transformers import OPTConfig, OPTForCausalLM
    config = OPTConfig(vocab_size=spec.vocab_size, hidden_size=spec.hidden_size, num_hidden_layers=spec.num_layers,
                       ffn_dim=spec.ffn_dim, num_attention_heads=spec.num_heads,
                       max_position_embeddings=spec.max_positions, word_embed_proj_dim=spec.embed_dim,
                       do_layer_norm_before=spec.do_layer_norm_before)
    with torch.device("meta"):
        model = OPTForCausalLM(config)
    source = DummyWeights(seed)
    state = {}
    for name, param in model.state_dict().items():
        canonical = "decoder.embed_tokens.weight" if name == "lm_head.weight" else name.removeprefix("model.")
        state[name] = source.get(canonical, tuple(param.shape), dtype)
    model.load_state_dict(state, assign=True)
    model.tie_weights()
    return model


def contenders(name: str, dtype):
    """(transformers model, flexh2o engine maker(batch), vocab size) for a model name."""
    if name == "smollm2":
        from transformers import AutoModelForCausalLM
        if not os.path.exists(SMOLLM2):
            sys.exit(f"{SMOLLM2} is missing: `make setup` downloads it")
        model = AutoModelForCausalLM.from_pretrained(os.path.dirname(SMOLLM2), gguf_file=os.path.basename(SMOLLM2),
                                                     dtype=dtype)
        source = {"model": SMOLLM2}
    elif name in PRESETS:
        model = opt_model(PRESETS[name], 0, dtype)
        source = {"model": name, "dummy": True, "seed": 0}
    else:
        sys.exit(f"--models: unknown model {name!r}; accepted: smollm2 or an OPT preset ({', '.join(PRESETS)})")
    model.generation_config.eos_token_id = None  # both run every step
    model.generation_config.pad_token_id = 0
    engine = lambda batch: Engine.from_pretrained(policy=Policy(gpu_batch_size=batch), device="cpu",  # noqa: E731
                                                  dtype=dtype, **source)
    return model.eval(), engine, model.config.vocab_size


def time_transformers(model, ids, gen_len):
    clock = FirstTokenClock()
    with torch.inference_mode():
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=gen_len, do_sample=False,
                             streamer=clock)
        end = time.perf_counter()
    first_token = clock.times[1]  # times[0]: the prompt is handed in before the forward pass
    return {"prefill_s": first_token - start, "decode_s": end - first_token, "wall_s": end - start}, out


def time_flexh2o(engine, ids, gen_len):
    start = time.perf_counter()
    out = engine.generate(ids, max_new_tokens=gen_len, eos_token_id=None)
    wall = time.perf_counter() - start
    stats = engine.last_stats
    return {"prefill_s": stats.prefill_seconds, "decode_s": stats.decode_seconds, "wall_s": wall}, out


def bench_batch(model, make_engine, vocab, batch, args):
    ids, _ = synthetic_prompts(batch, args.prompt_len, vocab, seed=batch)
    meter = LoadMeter()
    with make_engine(batch) as engine:
        go = {"transformers": lambda: time_transformers(model, ids, args.gen_len),
              "flexh2o": lambda: time_flexh2o(engine, ids, args.gen_len)}
        time_transformers(model, ids, 2)  # warm-up: one-time kernel selection and allocations
        time_flexh2o(engine, ids, 2)
        runs, outputs = {name: [] for name in ENGINES}, {}
        for run in range(args.runs):
            for name in (ENGINES if run % 2 == 0 else ENGINES[::-1]):  # alternate who goes first
                times, outputs[name] = go[name]()
                runs[name].append(times)
                print(f"  batch {batch} run {run} {name}: prefill {times['prefill_s']:.2f} s, "
                      f"decode {times['decode_s']:.2f} s, wall {times['wall_s']:.2f} s", flush=True)
    p, g = args.prompt_len, args.gen_len
    figures = {}
    for name, samples in runs.items():
        median = {key: statistics.median(s[key] for s in samples) for key in samples[0]}
        figures[name] = {**median, "prefill_tok_s": batch * p / median["prefill_s"],
                         "decode_tok_s": batch * (g - 1) / median["decode_s"],
                         "total_tok_s": batch * g / median["wall_s"], "runs": samples}
    new = {name: out[:, p:] for name, out in outputs.items()}
    return {"batch": batch, "figures": figures,
            "ratios": {key: figures["flexh2o"][key] / figures["transformers"][key]
                       for key in ("prefill_tok_s", "decode_tok_s", "total_tok_s")},
            "token_agreement": (new["flexh2o"] == new["transformers"]).float().mean().item(),
            "load": meter.result()}


def markdown(result) -> str:
    m = result["machine"]
    lines = [f"# flexh2o vs transformers generate, {result['prompt_len']} + {result['gen_len']} tokens", "",
             f"Machine: {m['cpu']}, {m['logical_cores']} cores, torch {m['torch']}, {m['torch_threads']} threads "
             f"for both engines, {result['dtype']}, everything on the CPU. Command: `{result['command']}`. "
             f"Medians of {result['runs']} runs per engine, the two alternating, after a warm-up each. Tokens/s: "
             "prefill = batch x prompt / time to the first token; decode = batch x (gen - 1) / the rest; "
             "total = batch x gen / the whole generate call.", ""]
    for model, blocks in result["models"].items():
        lines += [f"## {model}", "",
                  "| batch | engine | prefill tok/s | decode tok/s | total tok/s | load avg (start, end) "
                  "| other processes' CPU |",
                  "|---|---|---|---|---|---|---|"]
        for block in blocks:
            load = block["load"]
            for name in ENGINES:
                f = block["figures"][name]
                lines.append(f"| {block['batch']} | {name} | {f['prefill_tok_s']:.1f} | {f['decode_tok_s']:.2f} | "
                             f"{f['total_tok_s']:.2f} | {load['loadavg_1min'][0]:.2f}, {load['loadavg_1min'][1]:.2f} "
                             f"| {load['others_cpu_share']:.0%} |")
            r = block["ratios"]
            lines.append(f"| {block['batch']} | **flexh2o / transformers** | **{r['prefill_tok_s']:.2f}x** | "
                         f"**{r['decode_tok_s']:.2f}x** | **{r['total_tok_s']:.2f}x** | | |")
        agreement = ", ".join(f"batch {b['batch']} {b['token_agreement']:.0%}" for b in blocks)
        lines += ["", f"Greedy tokens equal to transformers': {agreement} (the two round differently, so a "
                  "near-tie can flip a token and the rest of its sequence with it).", ""]
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="smollm2,opt-125m", help="comma-separated: smollm2 and/or OPT presets")
    ap.add_argument("--batches", default="1,8,32", help="comma-separated batch sizes")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--gen-len", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(REPO, "results", "vs_transformers"))
    args = ap.parse_args()
    dtype = cpu_compute_dtype()
    result = {"command": "python " + " ".join(sys.argv), "dtype": str(dtype).removeprefix("torch."),
              "prompt_len": args.prompt_len, "gen_len": args.gen_len, "runs": args.runs,
              "machine": describe_machine(), "models": {}}
    for name in args.models.split(","):
        print(f"{name}: loading both engines ...", flush=True)
        model, make_engine, vocab = contenders(name, dtype)
        result["models"][name] = [bench_batch(model, make_engine, vocab, int(b), args)
                                  for b in args.batches.split(",")]
        del model
    write_results(args.out, result, markdown)


if __name__ == "__main__":
    main()
