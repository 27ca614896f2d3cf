"""Fixtures shared by every test: tiny OPT models and tokenizers written to disk, the test profile,
and the sub-directories' helpers on the path."""

import json
import os
import re
import shutil
import sys
import threading

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import OPTConfig, OPTForCausalLM, PreTrainedTokenizerFast

from flexh2o import native

# tests/ mirrors flexh2o's sub-packages; a test module takes another's helpers by its name (from
# test_llama import make_tiny_llama) from whichever sub-directory holds it.
TESTS = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = sorted(os.path.join(TESTS, d) for d in os.listdir(TESTS)
                      if os.path.isdir(os.path.join(TESTS, d)) and not d.startswith(("_", ".")))

# Tiny OPT shapes: plain pre-norm, a wider one, and opt-350m's post-norm with projections.
CONFIGS = {
    "tiny": dict(hidden_size=32, num_hidden_layers=2, ffn_dim=64, num_attention_heads=4),
    "wide": dict(hidden_size=48, num_hidden_layers=3, ffn_dim=96, num_attention_heads=6),
    "post_norm_proj": dict(hidden_size=32, num_hidden_layers=2, ffn_dim=64, num_attention_heads=2,
                           word_embed_proj_dim=16, do_layer_norm_before=False),
}
VOCAB = 128


def make_tiny_opt(directory, seed=0, safe_serialization=True, max_shard_size=None, **overrides):
    torch.manual_seed(seed)
    config = OPTConfig(**{"vocab_size": VOCAB, "max_position_embeddings": 64, "pad_token_id": 1, "bos_token_id": 2,
                          "eos_token_id": 2, **overrides})
    model = OPTForCausalLM(config).eval()
    # transformers' init (std 0.02) gives near-uniform logits; larger weights make greedy choices clear.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layer_norm" not in name:
                p.normal_(0, 0.3)
    kwargs = {"safe_serialization": safe_serialization}
    if max_shard_size:
        kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(directory, **kwargs)
    return model


def sixteen_bit_opt(tmp_path, width: torch.dtype, config: str = "tiny") -> str:
    """A tiny OPT of CONFIGS saved in `width` (safetensors), in a directory under tmp_path."""
    directory = str(tmp_path / f"opt-{config}-{width}".replace("torch.", ""))
    make_tiny_opt(directory, seed=3, **CONFIGS[config])
    OPTForCausalLM.from_pretrained(directory).to(width).save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """name -> (directory, transformers model) for every config in CONFIGS."""
    out = {}
    for i, (name, cfg) in enumerate(CONFIGS.items()):
        d = str(tmp_path_factory.mktemp(name))
        out[name] = (d, make_tiny_opt(d, seed=i, **cfg))
    return out


def padded_batch(batch, prompt_len, pads, seed=0):
    """Random prompts, row r left-padded with pads[r] padding tokens."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (batch, prompt_len), generator=g)
    mask = torch.ones_like(ids)
    for row, n in enumerate(pads):
        ids[row, :n] = 1
        mask[row, :n] = 0
    return ids, mask


@pytest.fixture(scope="session")
def transformers_smol():
    """transformers' own parse of SmolLM2's GGUF (config, tokenizer fields, float32 tensors named
    "model.*"), read once for the tests that compare against it: it dequantizes for about 10 s."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    import functools

    import gguf

    from flexh2o.checkpoints.gguf_reader import read_gguf
    # load_gguf_checkpoint only takes tensor names from this model; a meta one costs no memory.
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(AutoConfig.for_model(**read_gguf(SMOL_GGUF).config))
    # It builds gguf's (read-only) name map anew for each of the model's ~400 modules, a third of its
    # time: the same map, built once, gives the same names.
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
        return load_gguf_checkpoint(SMOL_GGUF, return_tensors=True, model_to_load=skeleton,
                                    torch_dtype=torch.float32)


@pytest.fixture(scope="session")
def tileable_model(tmp_path_factory):
    """A tiny OPT whose matrices fit torch's int4 kernel's tiles (rows a multiple of 32, columns of
    64) and flexh2o's own groups kernel (columns of 64)."""
    directory = str(tmp_path_factory.mktemp("tileable"))
    make_tiny_opt(directory, seed=7, hidden_size=64, num_hidden_layers=2, ffn_dim=128, num_attention_heads=4)
    return directory


FORCED_BATCH, FORCED_PROMPT = 4, 12  # forced_logprobs's prompts
COMPRESSED_TIERS = {"memory": (100, 0), "disk": (0, 0), "mixed": (34, 33)}  # the weights' gpu and cpu shares


def compressed_policy(tier: str, kv: dict):
    """forced_logprobs's batch as 2 gpu-batches, the weights compressed and placed as COMPRESSED_TIERS[tier]."""
    from flexh2o import Policy
    gpu, cpu = COMPRESSED_TIERS[tier]
    return Policy(FORCED_BATCH // 2, 2, w_gpu_percent=gpu, w_cpu_percent=cpu, compress_weight=True, **kv)


def forced_logprobs(directory, policy, tmp_path, dtype, inspect=lambda engine: None, new=5):
    """Teacher-forced log-probabilities of 4 padded prompts of 12 tokens (no argmax flip can make
    two runs' inputs differ), checking that nothing is allocated after the first decode step; and
    what inspect(engine) says of the loaded engine."""
    from flexh2o import Engine
    ids, mask = padded_batch(FORCED_BATCH, FORCED_PROMPT, pads=[0, 3, 1, 5], seed=4)
    forced = torch.randint(3, 128, (FORCED_BATCH, new), generator=torch.Generator().manual_seed(9))
    with Engine.from_pretrained(directory, policy=policy, device="cpu", dtype=dtype, offload_dir=str(tmp_path)) as engine:
        seen = inspect(engine)
        out = engine.generate(ids, mask, max_new_tokens=new, forced_tokens=forced)
        allocations = engine.last_stats.step_allocations
    assert allocations[2:] == [0] * (new - 2), allocations
    return out.forced_logprobs, seen


def generate_leaving_nothing(directory, policy, ids, mask, tmp_path, new_tokens, dtype=torch.float32, **engine_kw):
    """Greedy tokens and scores of a CPU run, checking that the run gives back every buffer and
    cache, leaves the offload dir empty once closed, and allocates nothing after the first decode step."""
    from flexh2o import Engine
    with Engine.from_pretrained(directory, policy=policy, device="cpu", dtype=dtype, offload_dir=str(tmp_path),
                                **engine_kw) as engine:
        before = dict(engine.tiers.bytes)
        out = engine.generate(ids, mask, max_new_tokens=new_tokens, output_scores=True, eos_token_id=None)
        assert engine.tiers.bytes == before, "every buffer and cache of the run is given back"
        allocations = engine.last_stats.step_allocations
    assert os.listdir(tmp_path) == [], "the offload dir must be empty after close()"
    assert allocations[2:] == [0] * (new_tokens - 2), allocations  # pooled: nothing new after the first decode step
    return out


def count_calls(monkeypatch, owner, names) -> dict:
    """How often each method `names` of class `owner` is called from now on (it still runs)."""
    calls = dict.fromkeys(names, 0)
    for name in names:
        original = getattr(owner, name)
        monkeypatch.setattr(owner, name, lambda self, *a, _o=original, _n=name:
                            (calls.__setitem__(_n, calls[_n] + 1), _o(self, *a))[1])
    return calls


def row_budgets(mask, hh_ratio: float, recent_ratio: float | None = None) -> tuple[list, list]:
    """Each sequence's (heavy, recent) slots from its own real prompt length L: int(ratio * L), at
    least 1 (docs/design.md, "H2O and the other policies")."""
    lengths = [int(n) for n in mask.sum(1)]
    recent_ratio = hh_ratio if recent_ratio is None else recent_ratio
    return ([max(1, int(hh_ratio * n)) for n in lengths], [max(1, int(recent_ratio * n)) for n in lengths])


def hf_generate(model, ids, mask, new_tokens, eos_token_id=None):
    return model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                          output_scores=True, return_dict_in_generate=True, eos_token_id=eos_token_id,
                          pad_token_id=1)


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMOL_GGUF = os.path.join(REPO, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")  # `make setup` downloads it


@pytest.fixture
def model_with_tokenizer(tiny_models, tmp_path):
    return with_word_tokenizer(tiny_models["tiny"][0], tmp_path)


def with_word_tokenizer(directory, dst):
    """dst (a directory): the model in `directory` linked there, with a word-level tokenizer."""
    for f in os.listdir(directory):
        os.symlink(os.path.join(directory, f), dst / f)
    words = ["the", "cat", "sat", "on", "a", "mat", "dog", "ran"]
    vocab = {"<pad>": 1, "</s>": 2, "<unk>": 3, **{w: 4 + i for i, w in enumerate(words)}}
    vocab.update({f"w{i}": i for i in range(len(vocab) + 1, VOCAB)})
    vocab["<s>"] = 0
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(dst)
    return dst


# A fixed CPU profile (close to what this project's 2-core machines measure): runs the tests plan
# or predict read it from a private cache, never the developer's, and never measure the machine.
TEST_CPU_PROFILE = {
    "name": "local", "source": "fixed test profile (tests/conftest.py)", "device": "cpu", "dtype": "float32",
    "gpu_mem": 16 << 30, "cpu_mem": 16 << 30, "disk_mem": 64 << 30,
    "matmul_flops": {"float32": {"1": 7e9, "16": 22e9, "64": 44e9, "256": 60e9, "4096": 67e9},
                     "bfloat16": {"1": 10e9, "256": 11e9}},
    "attention_flops": {"float32": 60e9, "bfloat16": 3e9}, "device_bandwidth": 15e9, "cpu_attention_bandwidth": 15e9,
    "h2d": 0.0, "d2h": 0.0, "h2d_pageable": 0.0, "d2h_pageable": 0.0, "memcpy": 9e9, "disk_read": 1.2e9,
    "disk_write": 0.56e9, "dequant": 0.7e9, "layer_overhead": 0.0003, "link_bandwidth": 1e9,
    "dequant_kernel": "native" if native.library() is not None else "torch", "kernels_build": native.build(),
    "attention_costs": {"prompt_fused": [1e-4, 2e-9], "prompt_observed": [4e-4, 5e-9],
                        "decode_fused": [1e-4, 35e-9], "decode_evicting": [6e-4, 70e-9]},
}


def with_the_kernels(home):
    """home, an XDG_CACHE_HOME, given the C kernels this process built (library() and its record):
    a subprocess that uses it loads them instead of building them again (seconds a build)."""
    lib = native.library()
    if lib is not None:
        (home / "flexh2o" / "native").mkdir(parents=True, exist_ok=True)
        for path in (lib._name, native.record_path(lib._name)):
            shutil.copy2(path, home / "flexh2o" / "native")
    return home


@pytest.fixture(scope="session", autouse=True)
def test_cache_home(tmp_path_factory):
    """XDG_CACHE_HOME of the whole session (subprocesses inherit it), holding TEST_CPU_PROFILE and the kernels."""
    home = with_the_kernels(tmp_path_factory.mktemp("cache_home"))
    (home / "flexh2o" / "hardware").mkdir(parents=True)
    (home / "flexh2o" / "hardware" / "local.json").write_text(json.dumps(TEST_CPU_PROFILE))
    before = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(home)
    yield home
    if before is None:
        os.environ.pop("XDG_CACHE_HOME")
    else:
        os.environ["XDG_CACHE_HOME"] = before


def fail_from(monkeypatch, owner, name, call: int, error: BaseException, when=lambda *args: True):
    """owner.name raises `error` from its `call`-th call on (counted over every thread), among the
    calls whose arguments `when` accepts; returns the list of those calls."""
    real, calls = getattr(owner, name), []
    lock = threading.Lock()

    def failing(*args, **kwargs):
        if not when(*args):
            return real(*args, **kwargs)
        with lock:
            calls.append(1)
            n = len(calls)
        if n >= call:
            raise error
        return real(*args, **kwargs)
    monkeypatch.setattr(owner, name, failing)
    return calls


def write(path, text: str):
    """A file at `path` (a pathlib.Path) holding `text`, its folders made."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def last_line(stderr: str) -> str:
    """The last line, past the progress bar's carriage returns."""
    return re.split(r"[\r\n]", stderr.rstrip())[-1]


@pytest.fixture(params=["native", "torch"])
def kernel_path(request, monkeypatch):
    """Runs a test through flexh2o's C kernels and again through torch's operations (FLEXH2O_NATIVE=0)."""
    if request.param == "torch":
        monkeypatch.setenv("FLEXH2O_NATIVE", "0")
    elif native.library() is None:
        pytest.skip("no C compiler: the kernels cannot be built here")
    return request.param
