"""Bad input of every kind ends in one line `error: <flag>: ...` and exit code 2, naming the flag at fault.

Flags alone are in FLAGS; model directories, checkpoints and prompts files are made per test.
"""

import json
import os
import sys
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

import flexh2o.engine.preflight
import flexh2o.runs.prompts
import flexh2o.cli.run_main
from flexh2o.models import resolve_model
from flexh2o.run import main
from test_weights import greedy

SMALL = ["--prompt-len", "8", "--gen-len", "2", "--gpu-batch-size", "4"]

FLAGS = [
    (["--weights", "gpu=100,gpu=0"], "--weights", "gpu is given twice"),
    (["--weights", "gpu=20,gpu=30,disk=50"], "--weights", "gpu is given twice"),
    (["--weights", ""], "--weights", "is empty"),
    (["--json-out", ""], "--json-out", "is empty"),
    (["--json-out", os.path.abspath(__file__) + "/report.json"], "--json-out", "cannot be written: Not a directory"),
    (["--json-out", "r" * 300 + ".json"], "--json-out", "cannot be written: File name too long"),
    (["--json-out", "no-such-folder-of-flexh2o/"], "--json-out", "names a directory (it ends in a slash)"),
    (["--prompts-file", " "], "--prompts-file", "is empty"),
    (["--weights", "gpu=150,cpu=-50"], "--weights", "within 0..100"),
    (["--cache", "gpu=70,cpu=50"], "--cache", "sum to 120, over 100"),
    (["--seed", "99999999999999999999999"], "--seed", "must be within 0.."),
    (["--seed", "-1"], "--seed", "must be within 0.."),
    (["--do-sample", "--temperature", "inf"], "--temperature", "finite"),
    (["--num-gpu-batches", "1000000000"], "--gpu-batch-size/--num-gpu-batches", "no placement of opt-125m"),
    (["--gpu-mem", "1MB", "--weights", "gpu=100"], "--gpu-mem", "which holds 1.00 MB (--gpu-mem)"),
    (["--cpu-mem", "1KB", "--weights", "gpu=0,cpu=100"], "--cpu-mem", "which holds 1.00 KB"),
    (["--model", "opt-175b", "--weights", "gpu=100", "--cache", "gpu=100"], "--weights/--cache", "on the compute device (CPU) tier"),
    (["--prompt-len", "2040", "--gen-len", "32"], "--prompt-len/--gen-len", "exceeds the 2048 positions"),
    (["--percent", "100", "0", "120", "0", "100", "0"], "--percent", "within 0..100"),
    (["--percent", "60", "50", "100", "0", "100", "0"], "--percent", "sum to 110"),
    (["--percent", "100", "0", "-5", "0", "100", "0"], "--percent", "within 0..100"),
    (["--gpu-batch-size", "0"], "--gpu-batch-size", "positive integer"),
    (["--num-gpu-batches", "-1"], "--num-gpu-batches", "positive integer"),
    (["--model", "gpt-17"], "--model", "unknown model 'gpt-17'"),
    (["--path", "/nonexistent/weights"], "--path", "does not exist"),
    (["--dtype", "int3"], "--dtype", "accepted: float16, bfloat16, float32"),
    (["--int8-activations", "--dtype", "bfloat16"], "--int8-activations", "applies to float32 runs"),
    (["--device", "tpu"], "--device", "accepted: cpu, cuda"),
    (["--gen-len", "0"], "--gen-len", "positive integer"),
    (["--top-p", "1.5", "--do-sample"], "--top-p", "within (0, 1]"),
    (["--percent", "100", "0"], "argument --percent", "expected 6 arguments"),  # argparse's own wording
    (["--weights", "gpu=50,ram=50"], "--weights", "expected gpu=P,cpu=P,disk=P"),
    (["--cache", "gpu=50,cpu=20,disk=20"], "--cache", "sum to 100, got 90"),
    (["--weights", "gpu=50", "--percent", "100", "0", "100", "0", "100", "0"], "--percent", "not both"),
    (["--act", "gpu=50,cpu=50"], "--act", "whole to one tier"),
    (["--gpu-mem", "lots"], "--gpu-mem", "expected a size such as 16GB"),
    (["--hh-ratio", "0"], "--hh-ratio", "in (0, 1]"),
    (["--hh-ratio", "0.05"], "--hh-ratio", "rounds to 0 heavy-hitter slots"),
    (["--hh-ratio", "0.5", "--recent-ratio", "0.05"], "--recent-ratio", "rounds to 0 recent slots"),
    (["--kv-policy", "lru"], "argument --kv-policy", "invalid choice"),
    (["--kv-policy", "sink"], "--hh-ratio", "needs a budget"),
    (["--kv-policy", "full", "--hh-ratio", "0.5"], "--kv-policy", "full keeps every token"),
    (["--compress-cache", "--cpu-cache-compute"], "--compress-cache", "cannot be combined with --cpu-cache-compute"),
    (["--join-every", "2"], "--join-every", "applies to a dataset job"),
    (["--fixed-blocks"], "--fixed-blocks", "applies to a dataset job"),
    (["--prompt-chunk", "64"], "--prompt-chunk", "applies to a dataset job"),
    (["--peer-timeout", "inf"], "--peer-timeout", "above 0 and at most 31536000 (a year), got inf"),
    (["--peer-timeout", "nan"], "--peer-timeout", "got nan"),
    (["--peer-timeout=-inf"], "--peer-timeout", "got -inf"),
    (["--peer-timeout", "0"], "--peer-timeout", "got 0"),
]


def run_main(argv, capsys) -> tuple[int, str]:
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    return code, capsys.readouterr().err.strip()


def assert_refused(argv, flag, text, capsys):
    code, err = run_main(argv, capsys)
    assert code == 2, err
    assert err.count("\n") == 0, err
    assert err.startswith(f"error: {flag}: ") and text in err, err


@pytest.mark.parametrize("argv,flag,text", FLAGS, ids=[f"{f[1]}:{f[2]}" for f in FLAGS])
def test_bad_flags(argv, flag, text, capsys):
    assert_refused(SMALL + argv, flag, text, capsys)


def test_a_model_too_large_for_any_placement_names_the_model(capsys, monkeypatch):
    """The smallest need is said, not what everything on the gpu tier would need."""
    monkeypatch.setattr(flexh2o.engine.preflight.shutil, "disk_usage", lambda path: SimpleNamespace(free=1 << 30))
    code, err = run_main(SMALL + ["--model", "opt-175b"], capsys)
    assert code == 2 and err.count("\n") == 0
    assert err.startswith("error: --model: no placement of opt-175b with a batch of 4 x 8+2 tokens fits")
    assert "the smallest (--weights gpu=0,cpu=0,disk=100" in err and "1.00 GB of disk are free" in err


CONFIGS = [
    ("a list", lambda c: [c], "holds a JSON list"),
    ("no ffn_dim", lambda c: {k: v for k, v in c.items() if k != "ffn_dim"}, "lacks ffn_dim"),
    ("0 heads", lambda c: {**c, "num_attention_heads": 0}, "num_attention_heads must be a positive integer"),
    ("0 layers", lambda c: {**c, "num_hidden_layers": 0}, "num_hidden_layers must be a positive integer"),
    ("string hidden_size", lambda c: {**c, "hidden_size": "32"}, "hidden_size must be a positive integer, got '32'"),
    ("negative vocab", lambda c: {**c, "vocab_size": -5}, "vocab_size must be a positive integer"),
    ("bool layers", lambda c: {**c, "num_hidden_layers": True}, "num_hidden_layers must be a positive integer"),
    ("1e9 layers", lambda c: {**c, "num_hidden_layers": 10**9}, "num_hidden_layers is 1000000000, over"),
    ("pad id outside", lambda c: {**c, "pad_token_id": 500}, "pad_token_id must be a token id"),
]


@pytest.mark.parametrize("change,text", [c[1:] for c in CONFIGS], ids=[c[0] for c in CONFIGS])
def test_bad_model_configs(tiny_models, tmp_path, change, text, capsys):
    directory, _ = tiny_models["tiny"]
    config = json.load(open(os.path.join(directory, "config.json")))
    (tmp_path / "config.json").write_text(json.dumps(change(config)))
    assert_refused(SMALL + ["--model", str(tmp_path)], "--model", text, capsys)


@pytest.mark.parametrize("text, says", [
    ('{"model_type": "opt", "vocab_size": ' + "9" * 5000 + "}", "holds an integer of more than"),
    ('{"model_type": "opt", "more": ' + "[" * 200000 + "]" * 200000 + "}", "is JSON nested too deeply"),
], ids=["5000-digit-integer", "nested-deeply"])
def test_a_config_that_is_no_json_we_read_is_one_line(tmp_path, text, says, capsys):
    (tmp_path / "config.json").write_text(text)
    assert_refused(SMALL + ["--model", str(tmp_path)], "--model", f"{tmp_path / 'config.json'} {says}", capsys)


@pytest.mark.parametrize("seconds", ["inf", "nan"])
def test_a_peer_timeout_that_is_no_time_is_one_line_on_every_rank_before_they_meet(seconds, capsys, monkeypatch):
    """Each rank checks its flags before the ranks meet: inf overflowed the meeting's timer on every rank."""
    import flexh2o.cli.distributed
    monkeypatch.setattr(flexh2o.cli.distributed, "open_store", lambda *a: pytest.fail("the ranks met"))
    for rank in range(2):
        for name, value in (("WORLD_SIZE", 2), ("RANK", rank), ("LOCAL_RANK", rank), ("LOCAL_WORLD_SIZE", 2)):
            monkeypatch.setenv(name, str(value))
        assert_refused(SMALL + ["--peer-timeout", seconds], "--peer-timeout", f"got {seconds}", capsys)


def test_a_null_word_embed_proj_dim_means_the_hidden_size(tiny_models, tmp_path):
    """As in HF's OPTConfig: null is not bad input."""
    directory, _ = tiny_models["tiny"]
    config = json.load(open(os.path.join(directory, "config.json")))
    (tmp_path / "config.json").write_text(json.dumps({**config, "word_embed_proj_dim": None}))
    assert resolve_model(str(tmp_path))[0].embed_dim == config["hidden_size"]


def model_with_bin(tiny_models, tmp_path, content, **save):
    directory, _ = tiny_models["tiny"]
    (tmp_path / "config.json").write_text(open(os.path.join(directory, "config.json")).read())
    torch.save(content, tmp_path / "pytorch_model.bin", **save)
    return str(tmp_path)


class Payload:
    def __reduce__(self):
        return (os.system, ("touch ran-the-payload",))


@pytest.mark.parametrize("content,text", [
    (7, "holds an object of type 'int', not a dict of named tensors"),
    ([torch.ones(2)], "holds an object of type 'list'"),
    ({"decoder.embed_tokens.weight": Payload()}, "holds objects other than tensors and was refused"),
], ids=["int", "list", "pickled code"])
def test_bad_checkpoints(tiny_models, tmp_path, content, text, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    directory = model_with_bin(tiny_models, tmp_path, content)
    code, err = run_main(SMALL + ["--model", directory, "--gpu-batch-size", "1"], capsys)
    assert code == 2 and err.count("\n") == 0 and text in err, err
    assert err.startswith("error: --model: ")  # only --model was given: not --path
    assert "weights_only" not in err and not os.path.exists("ran-the-payload")


def test_a_corrupt_checkpoint_is_called_corrupt_not_malicious(tiny_models, tmp_path, capsys):
    directory = model_with_bin(tiny_models, tmp_path, {})
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x02}q\x00not a pickle any further")
    code, err = run_main(SMALL + ["--model", directory, "--gpu-batch-size", "1"], capsys)
    assert code == 2 and err.count("\n") == 0, err
    assert "it is corrupt or not a PyTorch checkpoint" in err and "other than tensors" not in err, err


def test_a_weight_that_4_bit_groups_cannot_hold_is_refused_by_name(tiny_models, tmp_path, capsys):
    directory, _ = tiny_models["tiny"]
    (tmp_path / "config.json").write_text(open(os.path.join(directory, "config.json")).read())
    weights = load_file(os.path.join(directory, "model.safetensors"))
    weights["model.decoder.layers.1.fc2.weight"][3, 4] = float("inf")
    save_file(weights, str(tmp_path / "model.safetensors"))
    assert_refused(SMALL + ["--model", str(tmp_path), "--compress-weight"], "--compress-weight",
                   "weight decoder.layers.1.fc2.weight: cannot quantize a tensor holding inf or NaN", capsys)


def test_a_weight_the_compute_dtype_rounds_past_float16_is_refused_by_name(tiny_models, tmp_path, capsys):
    directory, _ = tiny_models["tiny"]
    (tmp_path / "config.json").write_text(open(os.path.join(directory, "config.json")).read())
    weights = load_file(os.path.join(directory, "model.safetensors"))
    weights["model.decoder.layers.1.fc2.weight"][3, 4] = 65504.0  # float16's largest: bfloat16 rounds it to 65536
    save_file(weights, str(tmp_path / "model.safetensors"))
    assert_refused(SMALL + ["--model", str(tmp_path), "--compress-weight", "--dtype", "bfloat16"], "--compress-weight",
                   "weight decoder.layers.1.fc2.weight: cannot quantize values beyond float16's range", capsys)


def test_a_model_directory_without_weights_names_model(tiny_models, tmp_path, capsys):
    directory, _ = tiny_models["tiny"]
    (tmp_path / "config.json").write_text(open(os.path.join(directory, "config.json")).read())
    assert_refused(SMALL + ["--model", str(tmp_path)], "--model", "no *.safetensors or *.bin", capsys)


def test_a_legacy_bin_checkpoint_loads_without_mmap(tiny_models, tmp_path):
    """torch.save's pre-zip format cannot be memory-mapped but loads with weights_only=True."""
    directory, _ = tiny_models["tiny"]
    tensors = load_file(os.path.join(directory, "model.safetensors"))
    legacy = model_with_bin(tiny_models, tmp_path, tensors, _use_new_zipfile_serialization=False)
    assert torch.equal(greedy(legacy), greedy(directory))


def test_a_disk_cap_too_small_names_disk_mem(tmp_path, capsys):
    argv = SMALL + ["--weights", "gpu=0,cpu=0", "--disk-mem", "100", "--offload-dir", str(tmp_path)]
    assert_refused(argv, "--disk-mem", "on the disk tier, which holds 100 bytes", capsys)


def refused_prompts(directory, path, capsys, text):
    argv = SMALL + ["--model", str(directory), "--gpu-batch-size", "2", "--prompts-file", str(path)]
    assert_refused(argv, "--prompts-file", text, capsys)


def test_a_binary_prompts_file(model_with_tokenizer, tmp_path, capsys):
    path = tmp_path / "prompts.txt"
    path.write_bytes(b"the cat\n\xff\xfe\x00binary\n")
    refused_prompts(model_with_tokenizer, path, capsys, "is not UTF-8 text (byte 8 cannot be decoded)")


def test_an_endless_prompts_file_is_refused(model_with_tokenizer, capsys):
    refused_prompts(model_with_tokenizer, "/dev/zero", capsys, "/dev/zero is a device, not a regular file")


def test_a_prompts_file_is_read_up_to_the_limit(model_with_tokenizer, capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(flexh2o.runs.prompts, "MAX_PROMPTS_BYTES", 1 << 20)
    big = tmp_path / "big.txt"
    big.write_bytes(b"a prompt\n" * (1 << 17))
    refused_prompts(model_with_tokenizer, str(big), capsys, "larger than 1.00 MB, the limit for a prompts file")


def test_a_byte_order_mark_is_not_part_of_the_first_prompt(model_with_tokenizer, tmp_path):
    tokenizer = flexh2o.runs.prompts.load_tokenizer(str(model_with_tokenizer))
    plain, marked = tmp_path / "plain.txt", tmp_path / "marked.txt"
    plain.write_text("the cat\r\nsat on a mat\n", encoding="utf-8")
    marked.write_text("the cat\r\nsat on a mat\n", encoding="utf-8-sig")
    assert marked.read_bytes().startswith(b"\xef\xbb\xbf")
    tokens = flexh2o.runs.prompts.read_prompts(str(plain), tokenizer, 2, 8)
    assert tokens == flexh2o.runs.prompts.read_prompts(str(marked), tokenizer, 2, 8)
    assert tokens[0] == tokenizer("the cat")["input_ids"]


def test_prompts_are_made_after_the_preflight_and_ram_measured_before(tiny_models, capsys, monkeypatch):
    """Prompts are batch-sized: made only once the pre-flight passed, after free memory was measured."""
    events = []
    measure, make = flexh2o.engine.preflight.psutil.virtual_memory, flexh2o.cli.run_main.synthetic_prompts
    monkeypatch.setattr(flexh2o.engine.preflight.psutil, "virtual_memory",  # records who measures
                        lambda: events.append(sys._getframe(1).f_code.co_name) or measure())
    monkeypatch.setattr(flexh2o.cli.run_main, "synthetic_prompts", lambda *a: events.append("prompts") or make(*a))
    directory, _ = tiny_models["tiny"]
    assert main(SMALL + ["--model", directory, "--dummy", "--gpu-batch-size", "1", "--dtype", "float32"]) == 0
    assert events.count("prompts") == 1 and "capacities" in events
    assert "capacities" not in events[events.index("prompts"):]


def test_a_huge_batch_is_refused_before_anything_batch_sized_exists(capsys, monkeypatch):
    monkeypatch.setattr(flexh2o.cli.run_main, "synthetic_prompts", lambda *a: pytest.fail("prompts made before the pre-flight"))
    argv = SMALL + ["--num-gpu-batches", "1000000000", "--percent", "100", "0", "100", "0", "100", "0"]
    assert_refused(argv, "--percent", "the policy needs", capsys)


def test_weights_read_from_the_model_directory_name_model_even_with_a_path(tiny_models, tmp_path, capsys):
    (tmp_path / "m").mkdir()
    directory = model_with_bin(tiny_models, tmp_path / "m", 7)
    argv = SMALL + ["--model", directory, "--path", str(tmp_path), "--gpu-batch-size", "1"]
    assert_refused(argv, "--model", "holds an object of type 'int'", capsys)


PLANNING = [
    (["--max-batch", "0"], "--max-batch", "positive integer"),
    (["--max-batch", "4", "--gpu-batch-size", "2"], "--max-batch", "applies only to a planned run"),
    (["--batch", "0"], "--batch", "positive integer"),
    (["--batch", "4", "--gpu-batch-size", "2"], "--batch", "applies only to a planned run"),
    (["--batch", "8", "--max-batch", "4"], "--max-batch", "is 4, below the 8 sequences of --batch"),
    (["--batch", "6", "--num-gpu-batches", "4"], "--num-gpu-batches", "4 does not divide the 6 sequences of --batch"),
    (["--batch", "4", "--input", "in.jsonl", "--output", "out.jsonl"], "--batch", "is the one-block mode's"),
    (["--allow-compression", "--weights", "gpu=100"], "--allow-compression", "applies only to a planned run"),
    (["--gpu-mem", "1KB", "--cpu-mem", "1KB", "--disk-mem", "1KB"], "--gpu-mem/--cpu-mem/--disk-mem",
     "no batch size or placement of opt-125m with 8+2 tokens fits this machine"),
]


@pytest.mark.parametrize("argv,flag,text", PLANNING, ids=[f"{f[1]}:{f[2]}" for f in PLANNING])
def test_bad_planning_flags(argv, flag, text, capsys):
    """A run without --gpu-batch-size or placement flags is planned (the fixed test profile)."""
    assert_refused(["--prompt-len", "8", "--gen-len", "2"] + argv, flag, text, capsys)
