"""lm-eval's `local-completions` model pointed at flexh2o's server: on the offline flexh2o_lastword
task it gets the loglikelihoods (within 1e-4, float32) and the accuracy that `flexh2o.lm_eval`'s
own model gets from the same weights, with lm-eval's Hugging Face tokenizer and with the server's
own (its `remote` tokenizer, which a GGUF model needs)."""

import pytest

lm_eval = pytest.importorskip("lm_eval")
from lm_eval import simple_evaluate  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from flexh2o import lm_eval as command  # noqa: E402
from serving import Running  # noqa: E402
from test_lm_eval import flexh2o_model, loglikelihoods, word_models  # noqa: E402,F401 - a fixture

TASK = "flexh2o_lastword"
LIMIT = 8


def run(tasks: TaskManager, model, model_args=None) -> tuple:
    out = simple_evaluate(model=model, model_args=model_args, tasks=[TASK], limit=LIMIT, task_manager=tasks,
                          bootstrap_iters=0, log_samples=True, verbosity="ERROR")
    found = sorted(out["samples"][TASK], key=lambda s: s["doc_id"])
    return loglikelihoods(found), out["results"][TASK]["acc,none"]


def test_local_completions_agrees_with_flexh2os_own_model(word_models, tmp_path):  # noqa: F811
    directory = word_models["llama"]
    tasks = TaskManager(include_path=command.TASKS_DIR)
    want, accuracy = run(tasks, flexh2o_model(directory))
    server = Running(["--model", directory, "--gpu-batch-size", "4", "--dtype", "float32", "--offload-dir",
                      str(tmp_path)])
    try:
        for backend in ("huggingface", "remote"):
            model_args = {"base_url": server.url + "/v1/completions", "model": server.service.state.ctx.model,
                          "tokenizer_backend": backend, "tokenizer": directory, "num_concurrent": 4,
                          "max_retries": 1, "max_length": 256}
            got, got_accuracy = run(tasks, "local-completions", model_args)
            assert len(got) == len(want) == LIMIT
            for (ll, greedy), (ll_want, greedy_want) in zip(got, want):
                assert ll == pytest.approx(ll_want, abs=1e-4) and greedy == greedy_want
            assert got_accuracy == accuracy
    finally:
        assert server.stop() == 0
    assert any(greedy for _, greedy in want) or accuracy == 0
