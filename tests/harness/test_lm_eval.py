"""flexh2o as lm-evaluation-harness's model: the offline tasks agree with lm-eval's own hf model on
tiny random Llama and OPT models (full cache, float32), and bad input is one line before any
weight loads."""

import json
import os
import sys

import pytest
import torch

lm_eval = pytest.importorskip("lm_eval")
from lm_eval import simple_evaluate  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.models.huggingface import HFLM  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers, processors  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, OPTConfig, OPTForCausalLM, PreTrainedTokenizerFast  # noqa: E402

from flexh2o import lm_eval as command  # noqa: E402
from flexh2o.engine.engine import Engine  # noqa: E402
from flexh2o.harness.model import FlexH2OLM  # noqa: E402
from flexh2o.checkpoints.fingerprint import model_sha256  # noqa: E402
from flexh2o.common.version import version  # noqa: E402

TASKS = ("flexh2o_lastword", "flexh2o_lastword_gen", "flexh2o_cloze")
LIMIT = 4
POSITIONS = 256


def task_words(limit: int) -> list[str]:
    """The word-level tokens of the first items of the offline tasks (the tiny models' vocabulary)."""
    split = pre_tokenizers.Whitespace()
    words = set()
    for name in ("lastword", "cloze"):
        with open(os.path.join(command.TASKS_DIR, f"{name}.jsonl")) as f:
            for line in list(f)[:limit]:
                row = json.loads(line)
                text = " ".join([row["context"], row.get("target", ""), *row.get("choices", [])])
                words.update(w for w, _ in split.pre_tokenize_str(text))
    return sorted(words)


def save_tokenizer(directory, words: list[str], bos: bool):
    vocab = {"<unk>": 0, "<pad>": 1, "</s>": 2, "<s>": 3, **{w: 4 + i for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    if bos:  # as OPT's tokenizer does: every encoding starts with its BOS
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 3)])
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>",
                            bos_token="<s>" if bos else None).save_pretrained(directory)
    return len(vocab)


@pytest.fixture(scope="module")
def word_models(tmp_path_factory):
    """kind -> directory of a tiny random model with a word-level tokenizer over the tasks' words:
    a Llama whose tokenizer adds nothing, an OPT whose tokenizer starts every text with BOS."""
    words, out = task_words(LIMIT), {}
    for seed, (kind, bos) in enumerate((("llama", False), ("opt", True))):
        directory = str(tmp_path_factory.mktemp(kind))
        vocab = save_tokenizer(directory, words, bos)
        torch.manual_seed(seed)
        if kind == "llama":
            config = LlamaConfig(vocab_size=vocab, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, intermediate_size=64, max_position_embeddings=POSITIONS,
                                 pad_token_id=1, bos_token_id=3, eos_token_id=2)
            model = LlamaForCausalLM(config)
        else:
            config = OPTConfig(vocab_size=vocab, hidden_size=32, num_hidden_layers=2, ffn_dim=64,
                               num_attention_heads=4, max_position_embeddings=POSITIONS, pad_token_id=1,
                               bos_token_id=3, eos_token_id=2)
            model = OPTForCausalLM(config)
        with torch.no_grad():  # larger weights than transformers' init, so that greedy choices are clear
            for name, p in model.named_parameters():
                p.normal_(1, 0.1) if "norm" in name else p.normal_(0, 0.3)
        model.eval().save_pretrained(directory)
        out[kind] = directory
    return out


def samples(lm, tasks=TASKS, limit=LIMIT) -> dict:
    out = simple_evaluate(model=lm, tasks=list(tasks), limit=limit, task_manager=TaskManager(include_path=command.TASKS_DIR),
                          bootstrap_iters=0, log_samples=True, verbosity="ERROR")
    return {task: sorted(out["samples"][task], key=lambda s: s["doc_id"]) for task in tasks}


def hf_model(directory, **kwargs):
    return HFLM(pretrained=directory, dtype="float32", batch_size=4, device="cpu", **kwargs)


def flexh2o_model(directory, **kwargs):
    return FlexH2OLM(model=directory, dtype="float32", gpu_batch_size=8, **kwargs)


def test_lm_evals_results_record_the_model_its_files_the_dtype_and_the_version(word_models):
    lm = FlexH2OLM(model=word_models["llama"], gpu_batch_size=8)  # the default dtype
    assert lm.get_model_info() == {"model": os.path.basename(word_models["llama"]), "dtype": "float32",
                                   "model_sha256": model_sha256(word_models["llama"]), "flexh2o_version": version()}


def loglikelihoods(task_samples: list) -> list:
    return [resp for s in task_samples for [resp] in s["resps"]]


@pytest.mark.parametrize("kind", [pytest.param(k, marks=pytest.mark.slow) for k in ("llama", "opt")])  # make test-all
def test_offline_tasks_agree_with_lm_evals_hf_model(word_models, kind):
    ours, theirs = samples(flexh2o_model(word_models[kind])), samples(hf_model(word_models[kind]))
    for task in ("flexh2o_lastword", "flexh2o_cloze"):
        a, b = loglikelihoods(ours[task]), loglikelihoods(theirs[task])
        assert len(a) == len(b) == LIMIT * (4 if task == "flexh2o_cloze" else 1)
        for (ll, greedy), (ll_hf, greedy_hf) in zip(a, b):
            assert ll == pytest.approx(ll_hf, abs=1e-4) and greedy == greedy_hf
    texts = [s["resps"][0][0] for s in ours["flexh2o_lastword_gen"]]
    assert texts == [s["resps"][0][0] for s in theirs["flexh2o_lastword_gen"]]
    assert any(texts), "every generation was empty: the comparison would hold for anything"


def rolling(lm, texts: list) -> list:
    return lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (t,), n) for n, t in enumerate(texts)],
                                    disable_tqdm=True)


def test_rolling_windows_agree_with_lm_evals_hf_model(word_models):
    """Documents longer than max_length: several windows each, every token scored once."""
    with open(os.path.join(command.TASKS_DIR, "lastword.jsonl")) as f:
        texts = [json.loads(line)["context"] for line in list(f)[:3]]
    ours = rolling(flexh2o_model(word_models["opt"], max_length=24), texts)
    theirs = rolling(hf_model(word_models["opt"], max_length=24), texts)
    assert ours == pytest.approx(theirs, abs=1e-4)


@pytest.mark.slow  # out of make test's 10 minutes (make test-all runs it)
def test_streamed_context_tokens_score_as_prefilled_ones_with_the_full_cache(word_models):
    plain = samples(flexh2o_model(word_models["llama"]), ["flexh2o_cloze"], 3)["flexh2o_cloze"]
    streamed = samples(flexh2o_model(word_models["llama"], streamed=12), ["flexh2o_cloze"], 3)["flexh2o_cloze"]
    for (a, ga), (b, gb) in zip(loglikelihoods(plain), loglikelihoods(streamed)):
        assert a == pytest.approx(b, abs=1e-4) and ga == gb


@pytest.mark.slow  # out of make test's 10 minutes (make test-all runs it)
def test_h2o_evicts_through_the_harness_and_the_weights_load_once(word_models, monkeypatch):
    loads = []
    real = Engine.load.__func__  # the harness loads through the commands' constructor
    monkeypatch.setattr(Engine, "load", classmethod(lambda cls, *a, **k: loads.append(1) or real(cls, *a, **k)))
    lm = flexh2o_model(word_models["llama"], streamed=16)
    full = loglikelihoods(samples(lm, ["flexh2o_cloze"], 3)["flexh2o_cloze"])
    lm.use_kv(kv_policy="h2o", hh_ratio=0.1, recent_ratio=0.1)
    h2o = loglikelihoods(samples(lm, ["flexh2o_cloze"], 3)["flexh2o_cloze"])
    assert len(loads) == 1
    assert max(abs(a - b) for (a, _), (b, _) in zip(full, h2o)) > 1e-3  # a 20% budget changes the scores


# A key or value that is wrong whatever the model: refused before lm-eval reads its task index.
@pytest.mark.parametrize("model_args, flag", [
    ("bogus=1", "model_args bogus"),
    ("gpu_batch_size=zero", "model_args gpu_batch_size"),
    ("kv_policy=lru", "model_args kv_policy"),
    ("kv_policy=h2o", "model_args hh_ratio"),
    ("compress_cache=maybe", "model_args compress_cache"),
])
def test_a_bad_model_argument_is_one_line_before_lm_eval_starts(word_models, monkeypatch, capsys, model_args, flag):
    import lm_eval.__main__
    monkeypatch.setattr(lm_eval.__main__, "cli_evaluate", lambda: pytest.fail("lm-eval started"))
    code = command.main(["--model_args", f"model={word_models['llama']}", model_args, "--tasks", "flexh2o_lastword"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1].startswith(f"error: {flag}:"), err[-1]


def test_good_model_arguments_and_ones_lm_eval_reads_itself_go_on_to_lm_eval(word_models, monkeypatch):
    import lm_eval.__main__
    started = []
    monkeypatch.setattr(lm_eval.__main__, "cli_evaluate",
                        lambda: started.append(sys.argv[sys.argv.index("--model_args"):]))
    model = word_models["llama"]
    for model_args in ([f"model={model},kv_policy=h2o,hh_ratio=0.2", "compress_cache=true"],
                       [json.dumps({"model": model, "bogus": 1})]):  # JSON: the model reads it, and refuses it then
        assert command.main(["--model_args", *model_args, "--tasks", "flexh2o_lastword", "--batch_size", "4"]) == 0
        assert started[-1][1:1 + len(model_args)] == model_args
    assert len(started) == 2


# Ones that take the model or the task's requests to see: each case runs lm-eval's command up to its
# task index (about 12 s), so they are in make test-all only.
@pytest.mark.slow
@pytest.mark.parametrize("model_args, flag", [
    ("kv_policy=h2o,hh_ratio=0.001", "model_args hh_ratio"),
    ("kv_policy=h2o,hh_ratio=0.2,recent_ratio=0.001", "model_args recent_ratio"),
    ("max_length=20", "--tasks"),
    ("max_length=1000", "model_args max_length"),
])
def test_bad_input_is_one_line_before_any_weight_loads(word_models, monkeypatch, capsys, model_args, flag):
    monkeypatch.setattr(Engine, "load", lambda *a, **k: pytest.fail("weights loaded"))  # from_pretrained too
    code = command.main(["--model_args", f"model={word_models['llama']},{model_args}", "--tasks",
                         "flexh2o_lastword", "--limit", "2"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1].startswith(f"error: {flag}:"), err[-1]


def test_the_command_runs_flexh2o_only_and_helps(capsys):
    assert command.main(["--model", "hf", "--tasks", "flexh2o_cloze"]) == 2
    assert capsys.readouterr().err.startswith("error: --model: this command runs lm-eval with --model flexh2o")
    assert command.main(["--help"]) == 0 and "streamed=N" in capsys.readouterr().out
    argv = command.harness_argv(["--tasks", "flexh2o_cloze"])
    assert argv[:3] == ["run", "--model", "flexh2o"] and "auto" in argv and command.TASKS_DIR in argv
    assert "auto" not in command.harness_argv(["--tasks", "t", "--batch_size", "8"])


@pytest.mark.slow  # out of make test's 10 minutes (make test-all runs it)
def test_placement_and_caps_pass_through_and_change_nothing_but_where_tensors_live(word_models, tmp_path):
    plain = loglikelihoods(samples(flexh2o_model(word_models["opt"]), ["flexh2o_lastword"], 3)["flexh2o_lastword"])
    lm = flexh2o_model(word_models["opt"], w_gpu_percent=0, w_cpu_percent=0, cache_gpu_percent=50,
                       cache_cpu_percent=0, offload_dir=str(tmp_path), max_memory="8GB")
    offloaded = loglikelihoods(samples(lm, ["flexh2o_lastword"], 3)["flexh2o_lastword"])
    assert lm.engine.policy.disk_percent("w") == 100 and lm.engine.caps["limit"] is not None
    assert lm.engine.tiers.disk.bytes_read > 0
    for (a, ga), (b, gb) in zip(plain, offloaded):
        assert a == pytest.approx(b, abs=1e-5) and ga == gb
    lm.close()


def test_lm_evals_own_batch_size_and_device_are_taken_and_values_typed():
    from flexh2o.harness.settings import DEFAULT_GPU_BATCH, read_settings
    s = read_settings({"model": "m", "batch_size": "8", "max_batch_size": 64, "device": "cpu"})
    assert (s.gpu_batch_size, s.device) == (8, "cpu")
    assert read_settings({"model": "m", "batch_size": "auto:4"}).gpu_batch_size == DEFAULT_GPU_BATCH
    assert read_settings({"model": "m", "batch_size": 8, "gpu_batch_size": 4}).gpu_batch_size == 4
    s = read_settings({"model": "m", "compress_cache": "true", "hh_ratio": "0.1", "streamed": 0, "device": "cpu"})
    assert s.compress_cache is True and s.hh_ratio == 0.1 and s.kv_policy is None and s.streamed == 0


def test_a_5000_digit_model_argument_is_said_in_a_short_line():
    from flexh2o.common.errors import UsageError
    from flexh2o.harness.settings import read_settings
    with pytest.raises(UsageError) as e:
        read_settings({"model": "m", "seed": "1" * 5000})
    assert e.value.flag == "model_args seed" and len(str(e.value)) < 200, e.value


@pytest.mark.parametrize("argv, flag, says", [
    ([], "--tasks", "give one or more task names"),
    pytest.param(["--tasks"], "--tasks", "give one or more task names", marks=pytest.mark.slow),
    pytest.param(["--tasks", ""], "--tasks", "give one or more task names", marks=pytest.mark.slow),
    pytest.param(["--tasks", ","], "--tasks", "give one or more task names", marks=pytest.mark.slow),
    pytest.param(["--tasks", "no_such_task_of_flexh2o"], "--tasks", "unknown task(s) no_such_task_of_flexh2o",
                 marks=pytest.mark.slow),  # lm-eval indexes every task it has first: 14 s
    pytest.param(["--tasks", "flexh2o_lastword,no_such_task_of_flexh2o"], "--tasks",
                 "unknown task(s) no_such_task_of_flexh2o", marks=pytest.mark.slow),
    (["--tasks", "flexh2o_lastword", "--limit", "0"], "--limit", "got '0'"),
    pytest.param(["--tasks", "flexh2o_lastword", "--limit", "-3"], "--limit", "got '-3'", marks=pytest.mark.slow),
    pytest.param(["--tasks", "flexh2o_lastword", "--limit=-0.5"], "--limit", "got '-0.5'", marks=pytest.mark.slow),
    pytest.param(["--tasks", "flexh2o_lastword", "--limit", "2.5"], "--limit", "got '2.5'", marks=pytest.mark.slow),
    pytest.param(["--tasks", "flexh2o_lastword", "--limit", "nan"], "--limit", "got 'nan'", marks=pytest.mark.slow),
    pytest.param(["--tasks", "flexh2o_lastword", "--limit", "inf"], "--limit", "got 'inf'", marks=pytest.mark.slow),
    (["--tasks", "flexh2o_lastword", "--device", "cuda"], "--device", "is cuda, model_args device is cpu"),
    pytest.param(["--tasks", "flexh2o_lastword", "--device=cuda:1"], "--device", "is cuda:1, model_args device is cpu",
                 marks=pytest.mark.slow),
    (["--tasks", "flexh2o_lastword", "--num_fewshot", "-1"], "--num_fewshot", "0 or more, got '-1'"),
    (["--tasks", "flexh2o_lastword", "-f", "two"], "--num_fewshot", "got 'two'"),
    (["--tasks", "flexh2o_lastword", "--num_fewshot=1.5"], "--num_fewshot", "got '1.5'"),
    (["--tasks", "flexh2o_lastword", "--output_path", ""], "--output_path", "is empty"),
], ids=lambda v: v if isinstance(v, str) else " ".join(v) or "no tasks")
def test_tasks_limit_and_device_are_one_line_before_any_weight_loads(word_models, monkeypatch, capsys, argv, flag,
                                                                     says):
    monkeypatch.setattr(Engine, "load", lambda *a, **k: pytest.fail("weights loaded"))  # from_pretrained too
    code = command.main(["--model_args", f"model={word_models['llama']},device=cpu", *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1].startswith(f"error: {flag}: ") and says in err[-1], err[-1]


@pytest.mark.parametrize("argv, device", [
    (["--model_args", "model=m"], "cpu"),  # flexh2o's default where CUDA is not there
    (["--model_args", "model=m,device=cuda:1"], "cuda:1"),
    (["--model_args", "model=m,device=cpu", "--device", "cpu"], "cpu"),
    (["--model_args", "model=m", "--device", "cuda:1"], "cuda:1"),
    (["--model_args=model=m,device=cuda:1", "--device=cuda:1"], "cuda:1"),
])
def test_one_device_reaches_lm_eval(monkeypatch, argv, device):
    """lm-eval's own default device (cuda:0) never does: the one given, else flexh2o's, goes as --device."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = command.harness_argv([*argv, "--tasks", "t"])
    given = [a.split("=", 1)[1] if "=" in a else out[n + 1] for n, a in enumerate(out) if a.split("=")[0] == "--device"]
    assert given == [device]


def test_model_args_device_and_lm_evals_own_arguments_make_one_model(word_models):
    """lm-eval passes its batch_size, max_batch_size and device beside model_args as keywords of the
    same call: model_args device=cpu was "got multiple values for keyword argument 'device'"."""
    harness = {"batch_size": "auto", "max_batch_size": None, "device": "cuda:0"}  # lm-eval's defaults
    lm = FlexH2OLM.create_from_arg_string(f"model={word_models['llama']},device=cpu,gpu_batch_size=4", harness)
    assert (lm.settings.device, lm.settings.gpu_batch_size) == ("cpu", 4)
    lm = FlexH2OLM.create_from_arg_obj({"model": word_models["llama"], "device": "cpu"}, harness)
    assert lm.settings.device == "cpu"
    assert FlexH2OLM.create_from_arg_obj({"model": word_models["llama"]}, harness).settings.device == "cuda:0"


@pytest.mark.slow  # lm-eval indexes its tasks first: 14 s
def test_model_args_device_runs_through_lm_eval(word_models, capsys):
    code = command.main(["--model_args", f"model={word_models['llama']},device=cpu,dtype=float32", "--tasks",
                         "flexh2o_lastword", "--limit", "1"])
    assert code == 0, capsys.readouterr().err


@pytest.mark.parametrize("under", ["results", "results.json", "deeper/results"])
def test_an_output_path_under_a_regular_file_is_one_line_before_lm_eval_starts(word_models, tmp_path, monkeypatch,
                                                                               capsys, under):
    """lm-eval writes its results only at the end, and a folder it cannot make there was a warning,
    exit 0 and no results."""
    import lm_eval.__main__
    started = []
    monkeypatch.setattr(lm_eval.__main__, "cli_evaluate", lambda: started.append(True))
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    argv = ["--model_args", f"model={word_models['llama']}", "--tasks", "flexh2o_lastword", "--output_path"]
    assert command.main([*argv, str(blocker / under)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: --output_path: {blocker / under}: {blocker} is not a directory, so lm-eval could not "
                   "write its results there: give a directory (made where missing), or a .json file name in one"]
    for good in (tmp_path / "new" / "results", tmp_path / "results.json", tmp_path):
        assert command.main([*argv, str(good)]) == 0
    assert len(started) == 3


@pytest.mark.slow  # 17 s; test_one_device_reaches_lm_eval checks the device it is given
def test_the_readme_command_runs_without_cuda_and_without_device(word_models, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    loaded = []
    real = Engine.load
    monkeypatch.setattr(Engine, "load", lambda *a, **k: (loaded.append(k.get("device")), real(*a, **k))[1])
    code = command.main(["--model_args", f"model={word_models['llama']},dtype=float32,kv_policy=h2o,hh_ratio=0.2,"
                         "recent_ratio=0.2", "--tasks", "flexh2o_lastword", "--limit", "2"])
    assert code == 0, capsys.readouterr().err
    assert loaded and all(d == "cpu" for d in loaded)
