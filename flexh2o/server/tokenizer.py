"""The model's tokenizer shared by the server's threads.

Hugging Face's fast tokenizers set their own padding and truncation state on each call, and two
threads in one at once fail ("Already borrowed"): every call goes through one lock here. The
engine thread, which decodes every token of every sequence, has a copy of its own (own_copy), so
that it never waits for a handler tokenizing a long prompt or rendering a chat template.
"""

import copy
import threading


class SharedTokenizer:
    def __init__(self, tokenizer):
        self._tokenizer, self._lock = tokenizer, threading.RLock()

    def __call__(self, *args, **kwargs):
        with self._lock:
            return self._tokenizer(*args, **kwargs)

    def encode(self, *args, **kwargs):
        with self._lock:
            return self._tokenizer.encode(*args, **kwargs)

    def decode(self, *args, **kwargs):
        with self._lock:
            return self._tokenizer.decode(*args, **kwargs)

    def apply_chat_template(self, *args, **kwargs):
        with self._lock:
            return self._tokenizer.apply_chat_template(*args, **kwargs)

    def own_copy(self) -> "SharedTokenizer":
        with self._lock:
            return SharedTokenizer(copy.deepcopy(self._tokenizer))

    def __getattr__(self, name):  # attributes (chat_template, eos_token...) as the tokenizer's
        return getattr(self._tokenizer, name)
