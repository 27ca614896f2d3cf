"""flexh2o against Hugging Face transformers' generate, same weights, same machine, one run.

    python scripts/bench_vs_transformers.py            # OPT-1.3B-size dummy weights, bf16, 8 x (256 + 32)

Both engines get identical dummy weights. Prefill time is the time to the first new token;
decode time the rest; the figures are medians over --runs interleaved runs after one warm-up.
Writes results/vs_transformers.{json,md}.
"""

import argparse
import os
import statistics
import sys
import time

import torch
from transformers import OPTConfig, OPTForCausalLM

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from flexh2o import Engine, Policy  # noqa: E402
from flexh2o.machine import cpu_compute_dtype, describe_machine  # noqa: E402
from flexh2o.models.opt import PRESETS  # noqa: E402
from flexh2o.prompts import synthetic_prompts  # noqa: E402
from flexh2o.output import write_json_atomic, write_text_atomic  # noqa: E402
from flexh2o.weights import DummyWeights  # noqa: E402


class FirstTokenClock:
    """A generate() streamer that notes when the prompt goes in and when the first token comes out."""

    def __init__(self):
        self.times = []

    def put(self, value):
        self.times.append(time.perf_counter())

    def end(self):
        self.times.append(time.perf_counter())


def hf_model(spec, seed, dtype):
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
        state[name] = source.get(canonical, tuple(param.shape)).to(dtype)
    model.load_state_dict(state, assign=True)
    model.tie_weights()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = spec.pad_token_id
    return model.eval()


def time_hf(model, ids, gen_len):
    clock = FirstTokenClock()
    with torch.inference_mode():
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=gen_len, do_sample=False,
                             streamer=clock)
        end = time.perf_counter()
    first_token = clock.times[1]  # times[0]: the prompt is handed in before the forward pass
    return first_token - start, end - first_token, out


def time_flexh2o(engine, ids, gen_len):
    out = engine.generate(ids, max_new_tokens=gen_len, eos_token_id=None)
    return engine.last_stats.prefill_seconds, engine.last_stats.decode_seconds, out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="opt-1.3b")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--gen-len", type=int, default=32)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "results", "vs_transformers"))
    args = ap.parse_args()
    dtype = cpu_compute_dtype()
    spec = PRESETS[args.model]
    ids, _ = synthetic_prompts(args.batch, args.prompt_len, spec.vocab_size, seed=0)

    print(f"building {args.model} twice with the same dummy weights ...", flush=True)
    engine = Engine.from_pretrained(args.model, policy=Policy(gpu_batch_size=args.batch), device="cpu",
                                    dtype=dtype, dummy=True, seed=0)
    model = hf_model(spec, 0, dtype)

    contenders = {"transformers": lambda: time_hf(model, ids, args.gen_len),
                  "flexh2o": lambda: time_flexh2o(engine, ids, args.gen_len)}
    time_hf(model, ids, 2)  # warm-up: one-time kernel selection and allocations
    time_flexh2o(engine, ids, 2)
    samples = {name: [] for name in contenders}
    outputs = {}
    for run in range(args.runs):
        for name, go in contenders.items():  # interleaved, so drifts of the machine hit both
            prefill, decode, out = go()
            samples[name].append((prefill, decode))
            outputs[name] = out
            print(f"run {run} {name}: prefill {prefill:.2f} s, decode {decode:.2f} s", flush=True)

    b, p, g = args.batch, args.prompt_len, args.gen_len
    figures = {}
    for name, runs in samples.items():
        prefill = statistics.median(r[0] for r in runs)
        decode = statistics.median(r[1] for r in runs)
        figures[name] = {"prefill_s": prefill, "decode_s": decode,
                         "prefill_tok_s": b * p / prefill, "decode_tok_s": b * (g - 1) / decode,
                         "total_tok_s": b * g / statistics.median(sum(r) for r in runs), "runs": runs}
    new_tokens = {n: o[:, p:] for n, o in outputs.items()}
    agree = (new_tokens["flexh2o"] == new_tokens["transformers"]).float().mean().item()
    ratios = {k: figures["flexh2o"][k] / figures["transformers"][k]
              for k in ("prefill_tok_s", "decode_tok_s", "total_tok_s")}
    result = {"command": "python " + " ".join(sys.argv), "model": args.model, "dtype": str(dtype).removeprefix("torch."),
              "batch": b, "prompt_len": p, "gen_len": g, "figures": figures, "ratios": ratios,
              "token_agreement": agree, "machine": describe_machine()}
    write_json_atomic(args.out + ".json", result)

    m = result["machine"]
    lines = [f"# flexh2o vs transformers generate: {args.model} dummy weights, {str(dtype).removeprefix('torch.')}, batch {b}, {p}+{g}", "",
             f"Machine: {m['cpu']}, {m['logical_cores']} cores, torch {m['torch']} ({m['torch_threads']} threads). "
             f"Command: `{result['command']}`. Medians of {args.runs} interleaved runs after a warm-up.", "",
             "| engine | prefill s | prefill tok/s | decode s | decode tok/s | total tok/s |",
             "|---|---|---|---|---|---|"]
    for name, f in figures.items():
        lines.append(f"| {name} | {f['prefill_s']:.2f} | {f['prefill_tok_s']:.1f} | {f['decode_s']:.2f} | "
                     f"{f['decode_tok_s']:.2f} | {f['total_tok_s']:.2f} |")
    lines += ["", f"flexh2o / transformers: prefill {ratios['prefill_tok_s']:.3f}x, decode {ratios['decode_tok_s']:.3f}x, "
              f"total {ratios['total_tok_s']:.3f}x. Generated tokens identical: {agree:.1%} "
              "(rounding differs between the two implementations).", ""]
    write_text_atomic(args.out + ".md", "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
