"""The server tests' fixtures (imported by name into each module): a tiny random Llama with a
word-level tokenizer and a chat template, and flexh2o's server on it, started in this process on
a free loopback port (flexh2o.server.command.serve_parsed on a thread)."""

import threading

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

WORDS = ("the a an and of to in is was it on for with as at by from that this be are or not have had one two "
         "three red blue green sea river moon sun star cat dog bird tree house city king queen ship song rain "
         "night day light dark old new small big fast slow warm cold time road hill stone fire water wind "
         "user assistant system : . , ? ! hello world name rivers capital France Paris").split()
TEMPLATE = ("{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} . {% endfor %}"
            "{% if add_generation_prompt %}assistant :{% endif %}")
POSITIONS = 128


def save_word_llama(directory: str, seed: int = 0) -> str:
    """A tiny Llama (2 layers, grouped-query attention) whose tokenizer knows WORDS, with a chat template."""
    vocab = {"<unk>": 0, "<pad>": 1, "</s>": 2, "<s>": 3, **{w: 4 + i for i, w in enumerate(dict.fromkeys(WORDS))}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>",
                                   bos_token="<s>")
    fast.chat_template = TEMPLATE
    fast.save_pretrained(directory)
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=64, max_position_embeddings=POSITIONS,
                         pad_token_id=1, bos_token_id=3, eos_token_id=2)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # larger weights than transformers' init, so that greedy choices are clear
        for name, p in model.named_parameters():
            p.normal_(1, 0.1) if "norm" in name else p.normal_(0, 0.3)
    model.eval().save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
def word_llama(tmp_path_factory) -> str:
    return save_word_llama(str(tmp_path_factory.mktemp("word-llama")))


class Running:
    """A server in a thread of this process: url, the service, and its exit code once stopped."""

    def __init__(self, argv: list[str]):
        from flexh2o.serve import build_parser
        from flexh2o.server.command import serve_parsed
        args = build_parser().parse_args(argv + ["--quiet"] + ([] if "--port" in argv else ["--port", "0"]))
        ready, self.code = threading.Event(), None

        def on_ready(service, url):
            self.service, self.url = service, url
            ready.set()

        def run():
            self.code = serve_parsed(args, on_ready)
            ready.set()
        self.thread = threading.Thread(target=run, name="test server", daemon=True)
        self.thread.start()
        ready.wait(120)
        if self.code is not None:
            raise RuntimeError(f"the server did not start (exit code {self.code})")

    def client(self, **kwargs):
        from openai import OpenAI
        return OpenAI(base_url=self.url + "/v1", api_key=kwargs.pop("api_key", "none"), max_retries=0, **kwargs)

    def stop(self) -> int:
        self.service.ask_stop()
        self.thread.join(120)
        return self.code


def start(word_llama, tmp_path, *flags) -> Running:
    return Running(["--model", word_llama, "--gpu-batch-size", "2", "--num-gpu-batches", "2", "--max-model-len",
                    str(POSITIONS), "--dtype", "float32", "--offload-dir", str(tmp_path / "offload"), *flags])


@pytest.fixture(scope="module")
def server(word_llama, tmp_path_factory):
    running = start(word_llama, tmp_path_factory.mktemp("server"), "--state-dir",
                    str(tmp_path_factory.mktemp("state")), "--max-queued", "64")
    yield running
    assert running.stop() == 0
