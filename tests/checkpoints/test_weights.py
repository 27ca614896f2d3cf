"""Weight sources: safetensors and .bin shards, dummy weights, and clear errors for bad checkpoints."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from flexh2o import Engine, Policy, UsageError
from flexh2o.models import resolve_model
from flexh2o.checkpoints.weights import DummyWeights
from conftest import CONFIGS, make_tiny_opt, padded_batch


def greedy(directory, **kw):
    engine = Engine.from_pretrained(directory, policy=Policy(gpu_batch_size=2), device="cpu",
                                    dtype=torch.float32, **kw)
    ids, mask = padded_batch(2, 6, pads=[0, 2])
    return engine.generate(ids, mask, max_new_tokens=5, eos_token_id=None)


def test_sharded_safetensors_load_the_same(tmp_path, tiny_models):
    directory, _ = tiny_models["tiny"]
    make_tiny_opt(tmp_path, seed=0, max_shard_size="20KB", **CONFIGS["tiny"])
    assert len([f for f in os.listdir(tmp_path) if f.endswith(".safetensors")]) > 1
    assert torch.equal(greedy(str(tmp_path)), greedy(directory))


def test_bin_shards_load_the_same(tmp_path, tiny_models):
    """Two torch.save shards, one with the `model.` prefix of OPTForCausalLM and one without it
    (as in the original facebook/opt-* checkpoints)."""
    directory, _ = tiny_models["tiny"]
    tensors = sorted(load_file(os.path.join(directory, "model.safetensors")).items())
    half = len(tensors) // 2
    torch.save(dict(tensors[:half]), tmp_path / "pytorch_model-00001-of-00002.bin")
    torch.save({k.removeprefix("model."): v for k, v in tensors[half:]}, tmp_path / "pytorch_model-00002-of-00002.bin")
    (tmp_path / "config.json").write_text(open(os.path.join(directory, "config.json")).read())
    assert torch.equal(greedy(str(tmp_path)), greedy(directory))


def test_preset_name_with_path(tmp_path):
    spec, path = resolve_model("facebook/opt-125m", None)
    assert (spec.name, spec.num_layers, spec.hidden_size, spec.num_heads, path) == ("opt-125m", 12, 768, 12, None)
    assert resolve_model("opt-30b")[0].hidden_size == 7168
    with pytest.raises(UsageError, match="--path"):
        resolve_model("opt-125m", str(tmp_path / "missing"))


def test_preset_with_a_path_of_another_shape_is_refused(tiny_models):
    directory, _ = tiny_models["tiny"]
    with pytest.raises(UsageError, match="--path.*does not describe opt-1.3b"):
        resolve_model("opt-1.3b", directory)


def test_missing_weight_is_a_clear_error(tmp_path, tiny_models):
    directory, _ = tiny_models["tiny"]
    tensors = load_file(os.path.join(directory, "model.safetensors"))
    del tensors["model.decoder.layers.1.fc2.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(open(os.path.join(directory, "config.json")).read())
    with pytest.raises(UsageError, match="lacks 1 weight.*decoder.layers.1.fc2.weight"):
        greedy(str(tmp_path))


def test_mismatched_shape_is_a_clear_error(tmp_path, tiny_models):
    directory, _ = tiny_models["tiny"]
    tensors = load_file(os.path.join(directory, "model.safetensors"))
    tensors["model.decoder.layers.0.fc1.weight"] = torch.zeros(8, 32)
    save_file(tensors, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(open(os.path.join(directory, "config.json")).read())
    with pytest.raises(UsageError, match=r"fc1.weight .* shape \[8, 32\], expected \[64, 32\]"):
        greedy(str(tmp_path))


def test_directory_without_weight_files(tmp_path, tiny_models):
    directory, _ = tiny_models["tiny"]
    (tmp_path / "config.json").write_text(open(os.path.join(directory, "config.json")).read())
    with pytest.raises(UsageError, match="no \\*.safetensors or \\*.bin"):
        greedy(str(tmp_path))


def test_non_opt_directory_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(UsageError, match="'gpt2' model; supported: opt"):
        resolve_model(str(tmp_path))


def test_dummy_weights_are_deterministic_and_finite(tiny_models):
    directory, _ = tiny_models["wide"]
    a = greedy(directory, dummy=True, seed=3)
    assert torch.equal(a, greedy(directory, dummy=True, seed=3))
    w = DummyWeights(0).get("decoder.layers.0.fc1.weight", (4096, 1024), torch.float32)
    assert w.shape == (4096, 1024) and torch.isfinite(w).all() and 0.015 < w.std() < 0.025
    assert not torch.equal(w, DummyWeights(0).get("decoder.layers.1.fc1.weight", (4096, 1024), torch.float32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dummy_weights_made_as_groups_are_the_groups_of_the_dummy_values(dtype):
    """get_packed copies the block's groups: bit for bit what quantizing get()'s tensor gives, also
    past the block's length, where get() repeats its window."""
    from flexh2o.compression.quant import Packed, quantize
    dummy = DummyWeights(seed=3)
    for name, shape in [("layers.0.fc1.weight", (2304, 4096)), ("layers.1.self_attn.q_proj.weight", (64, 128))]:
        packed = dummy.get_packed(name, shape, dtype)
        assert isinstance(packed, Packed) and packed.shape == shape
        assert torch.equal(packed.groups, quantize(dummy.get(name, shape, dtype)))
    assert dummy.get_packed("layers.0.fc1.weight", (8, 100), dtype) is None  # rows are not whole groups
    assert dummy.get_packed("layers.0.self_attn_layer_norm.weight", (64, 64), dtype) is None


def test_a_16_bit_checkpoint_compressed_for_float32_is_read_as_stored_to_the_same_groups(tmp_path, monkeypatch):
    """Quantizing reads float16 exactly: no widened float32 copy of each matrix is made first."""
    import transformers
    from flexh2o.checkpoints.weights import CheckpointWeights
    make_tiny_opt(str(tmp_path / "f32"), seed=3, hidden_size=64, num_hidden_layers=2, ffn_dim=128, num_attention_heads=4)
    transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "f32", dtype=torch.float16).save_pretrained(tmp_path / "f16")

    def placed_groups():
        with Engine.from_pretrained(str(tmp_path / "f16"), policy=Policy(2, compress_weight=True), device="cpu",
                                    dtype=torch.float32) as engine:
            return [seg.data.clone() for layer in engine.layers for p in layer.home for seg in p.segments]
    stored_dtypes = []
    original = CheckpointWeights.get_as_stored
    monkeypatch.setattr(CheckpointWeights, "get_as_stored",
                        lambda self, *a: stored_dtypes.append(original(self, *a).dtype) or original(self, *a))
    as_stored = placed_groups()
    assert stored_dtypes and set(stored_dtypes) == {torch.float16}
    monkeypatch.delattr(CheckpointWeights, "get_as_stored")  # widened to float32 first, as before
    widened = placed_groups()
    assert len(as_stored) == len(widened) and all(torch.equal(a, b) for a, b in zip(as_stored, widened))


def test_prefetch_asks_for_each_tensors_own_bytes(tmp_path, tiny_models, monkeypatch):
    """Engine.from_pretrained asks the kernel to read the next layers' tensors ahead; the ranges
    are those of the tensors' bytes in the safetensors file, and every weight is asked for."""
    from flexh2o.checkpoints import weights
    model, _ = tiny_models["tiny"]
    asked = []
    monkeypatch.setattr(weights.os, "posix_fadvise", lambda fd, offset, length, advice: asked.append(
        (os.readlink(f"/proc/self/fd/{fd}"), offset, length, advice)))
    with Engine.from_pretrained(model, policy=Policy(2), device="cpu", dtype=torch.float32) as engine:
        names = {name for layer in engine.layers[1:] for name, _ in layer.weight_specs()}
    source = weights.CheckpointWeights(model)
    got = {}
    for path, offset, length, advice in asked:
        assert advice == os.POSIX_FADV_WILLNEED
        with open(path, "rb") as f:
            f.seek(offset)
            got[(path, f.read(length))] = True
    for name in names:
        file, stored = source._where[name]
        tensor = load_file(file)[stored]
        assert (os.path.realpath(file), tensor.contiguous().view(torch.uint8).numpy().tobytes()) in got, name
