"""The Llama family (Llama, Mistral, Qwen2): greedy tokens and logits equal transformers' generate
(float32) with grouped-query attention, rotary scaling, tied heads and biases; every placement,
KV policy and compression runs through the same schedule and cache as OPT."""

import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, Qwen2Config, Qwen2ForCausalLM
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from flexh2o import Engine, Policy, UsageError
from flexh2o.models import resolve_model
from flexh2o.models.llama import spec_from_hf_config
from flexh2o.models.llama_layers import inverse_frequencies
from flexh2o.planning.cost_model import predict
from flexh2o.host.hardware import from_dict
from flexh2o.checkpoints.weights import DummyWeights
from flexh2o.kv import POLICIES

EVICTING = [name for name in POLICIES if name != "full"]
from conftest import TEST_CPU_PROFILE, VOCAB, generate_leaving_nothing, hf_generate, padded_batch, row_budgets
from llama_reference import MaskedEvictionLlama
from test_compression import reference as compression_reference, run as compression_run

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}
MODELS = {
    "gqa": (LlamaConfig, dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                              intermediate_size=64)),
    "llama3_tied": (LlamaConfig, dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                                      tie_word_embeddings=True, rope_scaling=LLAMA3)),
    "qwen2_bias": (Qwen2Config, dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                     intermediate_size=64)),
    # Groups of 3 query heads, head_dim apart from hidden_size / heads, linear RoPE, biases on q, k, v and o.
    "wide": (LlamaConfig, dict(hidden_size=48, num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2,
                               head_dim=16, intermediate_size=96, attention_bias=True,
                               rope_scaling={"rope_type": "linear", "factor": 2.0})),
}
CAUSAL_LM = {LlamaConfig: LlamaForCausalLM, Qwen2Config: Qwen2ForCausalLM}


def make_tiny_llama(directory, config_class, seed=0, **overrides):
    torch.manual_seed(seed)
    config = config_class(vocab_size=VOCAB, max_position_embeddings=64, pad_token_id=1, bos_token_id=2,
                          eos_token_id=2, **overrides)
    model = CAUSAL_LM[config_class](config).eval()
    with torch.no_grad():  # larger weights than transformers' init, so that greedy choices are clear
        for name, p in model.named_parameters():
            p.normal_(1, 0.1) if "norm" in name else p.normal_(0, 0.3)
    model.save_pretrained(directory)
    return model


@pytest.fixture(scope="module")
def llamas(tmp_path_factory):
    """name -> (directory, transformers model) for every config in MODELS."""
    out = {}
    for i, (name, (config_class, fields)) in enumerate(MODELS.items()):
        directory = str(tmp_path_factory.mktemp(name))
        out[name] = (directory, make_tiny_llama(directory, config_class, seed=i, **fields))
    return out


def run_engine(directory, ids, mask, tmp_path, new_tokens, nb=1, **policy):
    policy = Policy(gpu_batch_size=ids.shape[0] // nb, num_gpu_batches=nb, **policy)
    return generate_leaving_nothing(directory, policy, ids, mask, tmp_path, new_tokens)


def assert_same(out, tokens, logits, atol=1e-4):
    assert torch.equal(out.sequences[:, -tokens.shape[1]:], tokens)
    assert len(out.scores) == len(logits)
    for mine, theirs in zip(out.scores, logits):
        torch.testing.assert_close(mine, theirs.float(), atol=atol, rtol=0)


# -- against transformers ---------------------------------------------------------------------------

@pytest.mark.parametrize("nb", [1, 2])
@pytest.mark.parametrize("name", list(MODELS))
def test_greedy_tokens_and_logits_match_transformers(llamas, tmp_path, name, nb):
    directory, model = llamas[name]
    ids, mask = padded_batch(4, 12, pads=[0, 3, 7, 11], seed=2)
    ref = hf_generate(model, ids, mask, 10)
    assert_same(run_engine(directory, ids, mask, tmp_path, 10, nb), ref.sequences[:, 12:], ref.scores)


def test_a_padded_prompt_step_runs_its_real_tokens_only(llamas, tmp_path, monkeypatch):
    from flexh2o.models import real_tokens
    directory, _ = llamas["wide"]
    ids, mask = padded_batch(4, 12, pads=[0, 3, 7, 11], seed=5)
    packed = run_engine(directory, ids, mask, tmp_path, 6)
    monkeypatch.setattr(real_tokens, "MIN_PADDING", 2.0)  # never: every position computed
    full = run_engine(directory, ids, mask, tmp_path, 6)
    assert_same(packed, full.sequences, full.scores)


@pytest.mark.parametrize("rope", [None, {"rope_type": "linear", "factor": 4.0}, LLAMA3,
                                  {**LLAMA3, "original_max_position_embeddings": 8192}])
@pytest.mark.parametrize("head_dim,theta", [(8, 10000.0), (128, 500000.0)])
def test_rotary_frequencies_equal_transformers(rope, head_dim, theta):
    config = LlamaConfig(hidden_size=2 * head_dim, num_attention_heads=2, rope_theta=theta,
                         rope_scaling=None if rope is None else dict(rope))
    spec = spec_from_hf_config(config.to_dict(), "x")
    torch.testing.assert_close(inverse_frequencies(spec), LlamaRotaryEmbedding(config).inv_freq, rtol=1e-6, atol=0)


@pytest.mark.parametrize("name", list(MODELS))
def test_param_count_equals_transformers(llamas, name):
    directory, model = llamas[name]
    assert resolve_model(directory)[0].param_count() == sum(p.numel() for p in model.parameters())


# -- config.json --------------------------------------------------------------------------------------

def spec_of(config_class, **fields):
    return spec_from_hf_config(config_class(**fields).to_dict(), "m")


def test_settings_of_each_model_type():
    qwen = spec_of(Qwen2Config, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, eos_token_id=[5, 7])
    assert (qwen.qkv_bias, qwen.o_bias, qwen.num_kv_heads, qwen.head_dim) == (True, False, 2, 8)
    assert (qwen.eos_token_id, qwen.eos_token_ids, qwen.pad_token_id) == (5, (5, 7), 5)  # pads with eos
    # Within a sliding window, attention is plain causal: runs are capped at the window where one is used.
    windowed = dict(max_position_embeddings=64, sliding_window=32)
    assert spec_of(Qwen2Config, use_sliding_window=True, **windowed).max_positions == 32
    assert spec_of(Qwen2Config, **windowed).max_positions == 64  # use_sliding_window is off by default
    assert spec_of(MistralConfig, **windowed).max_positions == 32
    assert spec_of(MistralConfig, max_position_embeddings=64, sliding_window=None).max_positions == 64
    llama = spec_of(LlamaConfig, attention_bias=True, head_dim=64, pad_token_id=None, eos_token_id=None)
    assert (llama.qkv_bias, llama.o_bias, llama.head_dim) == (True, True, 64)
    assert (llama.eos_token_id, llama.pad_token_id) == (None, 0)
    # The format of transformers before 5: rope_theta and rope_scaling beside the other fields.
    old = spec_from_hf_config({**LlamaConfig().to_dict(), "rope_parameters": None, "rope_theta": 5e5,
                               "rope_scaling": {"type": "linear", "factor": 2.0}}, "m")
    assert (old.rope_theta, old.rope_scaling.kind, old.rope_scaling.factor) == (5e5, "linear", 2.0)


BAD = [
    ("yarn", lambda c: {**c, "rope_parameters": {"rope_type": "yarn", "factor": 2.0}}, "RoPE type 'yarn'"),
    ("llama3 without factor", lambda c: {**c, "rope_parameters": {**LLAMA3, "factor": None}},
     "rope_parameters.factor must be a positive number"),
    ("llama3 high <= low", lambda c: {**c, "rope_parameters": {**LLAMA3, "high_freq_factor": 1.0}}, "must exceed"),
    ("nested rope", lambda c: {**c, "rope_parameters": {"full_attention": {"rope_type": "default"}}}, "one object"),
    ("theta", lambda c: {**c, "rope_parameters": {"rope_theta": -1}}, "rope_theta must be a positive number"),
    ("gelu", lambda c: {**c, "hidden_act": "gelu"}, "activation 'gelu' is not SiLU"),
    ("mlp bias", lambda c: {**c, "mlp_bias": True}, "mlp_bias"),
    ("kv heads", lambda c: {**c, "num_key_value_heads": 3}, "not a multiple of num_key_value_heads"),
    ("odd head_dim", lambda c: {**c, "head_dim": 7}, "head_dim must be even"),
    ("no intermediate_size", lambda c: {k: v for k, v in c.items() if k != "intermediate_size"},
     "lacks intermediate_size"),
    ("eos outside", lambda c: {**c, "eos_token_id": [2, 500]}, "eos_token_id must be a token id"),
    ("eps", lambda c: {**c, "rms_norm_eps": "1e-5"}, "rms_norm_eps must be a positive number"),
    ("partial rotary", lambda c: {**c, "partial_rotary_factor": 0.5}, "partial rotary"),
    ("bias", lambda c: {**c, "attention_bias": "yes"}, "attention_bias must be true or false"),
]


@pytest.mark.parametrize("change,text", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_configs_name_the_flag_in_one_line(llamas, tmp_path, change, text):
    directory, model = llamas["gqa"]
    (tmp_path / "config.json").write_text(json.dumps(change(model.config.to_dict())))
    with pytest.raises(UsageError) as e:
        resolve_model(str(tmp_path))
    assert e.value.flag == "--model" and text in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_presets_and_their_checkpoint_directories(llamas):
    spec, path = resolve_model("HuggingFaceTB/SmolLM2-135M")
    assert (spec.name, spec.family, spec.num_kv_heads, spec.head_dim, path) == ("smollm2-135m", "llama", 3, 64, None)
    assert spec.param_count() == 134_515_008
    assert resolve_model("meta-llama/Llama-3.1-8B")[0].rope_scaling.kind == "llama3"
    with pytest.raises(UsageError, match="--path.*does not describe smollm2-135m"):
        resolve_model("smollm2-135m", llamas["gqa"][0])


# -- offloading, KV policies, compression ------------------------------------------------------------

PLACEMENTS = [((100, 0), (100, 0), 1, True, "gpu"), ((50, 50), (0, 100), 3, True, "cpu"),
              ((0, 0), (0, 0), 1, False, "gpu"), ((0, 100), (34, 33), 3, False, "gpu"),
              ((50, 0), (0, 0), 3, True, "cpu"), ((0, 50), (34, 33), 1, True, "gpu")]


@pytest.fixture(scope="module")
def wide_reference(llamas):
    ids, mask = padded_batch(6, 10, pads=[(r * 3) % 8 for r in range(6)], seed=5)
    return ids, mask, hf_generate(llamas["wide"][1], ids, mask, 6)


@pytest.mark.parametrize("weights,cache,nb,overlap,act", PLACEMENTS,
                         ids=[f"w{w[0]}-{w[1]}_c{c[0]}-{c[1]}_nb{nb}_{o}_{a}" for w, c, nb, o, a in PLACEMENTS])
def test_every_placement_gives_the_output_of_transformers(llamas, wide_reference, tmp_path, weights, cache, nb,
                                                          overlap, act):
    ids, mask, ref = wide_reference
    out = run_engine(llamas["wide"][0], ids, mask, tmp_path, 6, nb, w_gpu_percent=weights[0], w_cpu_percent=weights[1],
                     cache_gpu_percent=cache[0], cache_cpu_percent=cache[1], overlap=overlap,
                     act_gpu_percent=100 if act == "gpu" else 0, act_cpu_percent=100 if act == "cpu" else 0)
    assert_same(out, ref.sequences[:, 10:], ref.scores)


PROMPT, NEW = 20, 8
TIERS = [((100, 0), 1), ((0, 0), 2), ((34, 33), 3)]  # (cache gpu, cache cpu) and gpu-batches


# Not Keyformer: its scores take noise from the engine's own generator, which the masked reference lacks
@pytest.mark.parametrize("kv_policy", [name for name in EVICTING if name != "keyformer"])
def test_evicting_policies_match_the_masked_reference_with_grouped_heads(llamas, tmp_path, kv_policy):
    _, hf = llamas["wide"]
    ids, mask = padded_batch(6, PROMPT, pads=[0, 3, 0, 7, 1, 12], seed=5)
    tokens, logits = MaskedEvictionLlama(hf, kv_policy, *row_budgets(mask, 0.2)).generate(ids, mask, NEW)
    for cache, nb in TIERS:
        out = run_engine(llamas["wide"][0], ids, mask, tmp_path, NEW, nb, cache_gpu_percent=cache[0],
                         cache_cpu_percent=cache[1], kv_policy=kv_policy, hh_ratio=0.2)
        assert_same(out, tokens, logits)


def test_eviction_changes_the_output(llamas, tmp_path):
    """The reference comparison above could pass vacuously if nothing were ever evicted."""
    ids, mask = padded_batch(6, PROMPT, pads=[0, 3, 0, 7, 1, 12], seed=5)
    full = run_engine(llamas["wide"][0], ids, mask, tmp_path, NEW)
    h2o = run_engine(llamas["wide"][0], ids, mask, tmp_path, NEW, hh_ratio=0.2)
    assert not all(torch.allclose(a, b, atol=1e-3) for a, b in zip(full.scores, h2o.scores))


@pytest.mark.parametrize("kv_policy", EVICTING)
def test_a_budget_holding_every_token_equals_the_full_cache(llamas, tmp_path, kv_policy):
    directory, _ = llamas["gqa"]
    ids, mask = padded_batch(4, PROMPT, pads=[0, 2, 5, 9], seed=6)
    full = run_engine(directory, ids, mask, tmp_path, NEW)
    big = run_engine(directory, ids, mask, tmp_path, NEW, 2, cache_gpu_percent=0, cache_cpu_percent=50,
                     kv_policy=kv_policy, hh_ratio=1.0)  # 40 slots >= 20 + 8
    assert_same(big, full.sequences[:, PROMPT:], full.scores)


def test_keyformer_runs_with_grouped_heads_on_every_tier(llamas, tmp_path):
    ids, mask = padded_batch(6, PROMPT, pads=[0, 3, 0, 7, 1, 12], seed=5)
    outs = [run_engine(llamas["wide"][0], ids, mask, tmp_path, NEW, nb, cache_gpu_percent=c[0],
                       cache_cpu_percent=c[1], kv_policy="keyformer", hh_ratio=0.2) for c, nb in TIERS]
    assert all(torch.isfinite(s).all() for out in outs for s in out.scores)


@pytest.mark.parametrize("kv", [{}, {"hh_ratio": 0.3}, {"kv_policy": "local", "hh_ratio": 0.2, "recent_ratio": 0.4}])
def test_compressed_weights_and_cache_equal_the_engine_on_round_tripped_tensors(llamas, tmp_path, monkeypatch, kv):
    directory, _ = llamas["wide"]
    policy = Policy(2, 3, 0, 50, 34, 33, compress_weight=True, compress_cache=True, **kv)
    out = compression_run(directory, policy, tmp_path)
    ref = compression_reference(directory, policy, tmp_path, monkeypatch)
    assert_same(out, ref.sequences, ref.scores)


# -- dummy weights, planning ---------------------------------------------------------------------------

def test_dummy_weights_give_finite_output_with_unit_norms(llamas, tmp_path):
    directory, _ = llamas["qwen2_bias"]
    for name in ("layers.0.input_layernorm.weight", "layers.1.post_attention_layernorm.weight", "norm.weight"):
        assert torch.equal(DummyWeights(0).get(name, (32,), torch.float32), torch.ones(32))
    policy = Policy(gpu_batch_size=2, w_gpu_percent=30, w_cpu_percent=30)
    with Engine.from_pretrained(directory, policy=policy, device="cpu", dtype=torch.float32, dummy=True,
                                offload_dir=str(tmp_path)) as engine:
        out = engine.generate(torch.randint(3, VOCAB, (2, 8)), max_new_tokens=3, output_scores=True)
    assert all(torch.isfinite(s).all() for s in out.scores)


def test_the_cost_model_predicts_a_llama_run():
    spec, _ = resolve_model("smollm2-135m")
    prediction = predict(spec, Policy(gpu_batch_size=8, w_gpu_percent=50, w_cpu_percent=50, hh_ratio=0.2), 256, 16,
                         from_dict(TEST_CPU_PROFILE, "test"), "float32")
    assert 0 < prediction.prefill_seconds and 0 < prediction.decode_seconds
