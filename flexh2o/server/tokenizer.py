"""The model's tokenizer shared by the server's threads (the HTTP handlers and the engine thread).

Hugging Face's fast tokenizers set their own padding and truncation state on each call, and two
threads in one at once fail ("Already borrowed"): every call goes through one lock here.
"""

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

    def __getattr__(self, name):  # attributes (chat_template, eos_token...) as the tokenizer's
        return getattr(self._tokenizer, name)
