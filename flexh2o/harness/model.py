"""flexh2o's model for lm-evaluation-harness, registered as "flexh2o".

Tokenization follows lm-eval's hf model (the tokenizer's own special tokens unless add_bos_token
says otherwise, the BOS token as the context of an empty one), so that with the full cache the
two agree; the weights load at the first request, once the requests of that kind are checked.
"""

import dataclasses

import torch
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window, simple_parse_args_string

from flexh2o.checkpoints.fingerprint import model_sha256
from flexh2o.common.messages import progress_bar
from flexh2o.common.errors import UsageError
from flexh2o.common.version import version
from flexh2o.jobs.input import sampling
from flexh2o.jobs.plans import FixedPlan
from flexh2o.models import eos_ids, resolve_model
from flexh2o.runs.prompts import load_tokenizer
from flexh2o.harness.generation import generate
from flexh2o.harness.requests import check_budgets, context_item, loglikelihood_item
from flexh2o.harness.scoring import score
from flexh2o.harness.settings import PERCENT_KEYS, read_settings

GEN_KWARGS = ("until", "max_gen_toks", "do_sample", "temperature", "top_p", "top_k")


@register_model("flexh2o")
class FlexH2OLM(TemplateLM):
    def __init__(self, **model_args):
        super().__init__()
        self.settings = s = read_settings(model_args)
        self.spec, weights_dir = resolve_model(s.model, s.path)
        self.weights_dir = weights_dir
        self.tokenizer = load_tokenizer(weights_dir)
        if self.tokenizer is None:
            raise UsageError("model_args model", f"{s.model} has no tokenizer files: requests cannot be tokenized")
        self.max_length = s.max_length or self.spec.max_positions - 1
        if self.max_length > self.spec.max_positions - 1:
            raise UsageError("model_args max_length", f"at most {self.spec.max_positions - 1} for {self.spec.name} "
                             f"({self.spec.max_positions} positions; see flexh2o/harness/requests.py), got "
                             f"{self.max_length}")
        self.engine = self.plans = None
        self._tasks: list = []
        self._prefix_text = self.tokenizer.decode([self.prefix_token_id])  # a string holding it has its BOS

    # lm-eval passes its own batch_size, max_batch_size and device beside model_args, as keyword
    # arguments of the same call: a key in both was a TypeError. model_args win (flexh2o.lm_eval
    # refuses a --device other than model_args' device before this).
    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None):
        harness = {k: v for k, v in (additional_config or {}).items() if v is not None and k not in arg_dict}
        return cls(**arg_dict, **harness)

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None):
        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    # -- lm-eval's interface ------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_token_id
        return self.tokenizer.eos_token_id if bos is None else bos

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.name_or_path.replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        add = self.settings.add_bos_token if add_special_tokens is None else add_special_tokens
        if add_special_tokens is None and self._prefix_text and string.startswith(self._prefix_text):
            add = False  # the string holds its BOS already
        return self.tokenizer.encode(string, **({} if add is None else {"add_special_tokens": add}))

    def loglikelihood(self, requests, disable_tqdm: bool = False):
        self._tasks = [getattr(r, "task_name", None) for r in requests]
        return super().loglikelihood(requests, disable_tqdm=disable_tqdm)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
        s = self.settings
        tasks = self._tasks if len(self._tasks) == len(requests) else [None] * len(requests)
        items = [loglikelihood_item(context, continuation, self.max_length, s.truncate, s.streamed, task)
                 for (_, context, continuation), task in zip(requests, tasks)]
        results = self._score(items, "loglikelihood requests", disable_tqdm)
        for (strings, _, _), result in zip(requests, results):
            self.cache_hook.add_partial("loglikelihood", strings, result)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        items, owners = [], []
        for n, request in enumerate(requests):
            windows = get_rolling_token_windows(token_list=self.tok_encode(request.args[0]),
                                                prefix_token=self.prefix_token_id, max_seq_len=self.max_length,
                                                context_len=1)
            for context, predicted in map(make_disjoint_window, windows):
                items.append(loglikelihood_item(context, predicted, self.max_length, False, 0,
                                                getattr(request, "task_name", None)))
                owners.append(n)
        totals = [0.0] * len(requests)
        for owner, (logprob, _) in zip(owners, self._score(items, "rolling windows", disable_tqdm)):
            totals[owner] += logprob
        for request, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        s, eos = self.settings, self.tokenizer.decode([self.eot_token_id])
        groups: dict = {}  # one job per setting: sampling is per block, max_tokens and stops per record
        for n, request in enumerate(requests):
            context, gen_kwargs = request.args
            kwargs = normalize_gen_kwargs(dict(gen_kwargs), s.max_gen_toks)
            unknown = sorted(set(kwargs) - set(GEN_KWARGS))
            if unknown:
                raise UsageError("--gen_kwargs", f"{unknown[0]} is not taken by flexh2o; accepted: "
                                 f"{', '.join(GEN_KWARGS)}")
            temperature = float(kwargs.get("temperature") or 0.0) if kwargs.get("do_sample") else 0.0
            how = sampling(temperature, float(kwargs.get("top_p") or 1.0), int(kwargs.get("top_k") or 0))
            item = context_item(self.tok_encode(context), int(kwargs["max_gen_toks"]), self.spec.max_positions,
                                s.truncate, getattr(request, "task_name", None))
            groups.setdefault(how, []).append((n, item, handle_stop_sequences(kwargs.get("until"), eos)))
        check_budgets(self.settings.policy(1), [(c.tokens, c.task) for g in groups.values() for _, c, _ in g])
        texts = [None] * len(requests)
        with self._progress(len(requests), "generate_until requests", disable_tqdm) as bar:
            for how, group in groups.items():
                contexts = [c for _, c, _ in group]
                engine = self._engine(max(len(c.tokens) for c in contexts), max(c.max_tokens for c in contexts))
                with torch.no_grad():
                    out = generate(engine, contexts, [stop for _, _, stop in group], how, s.seed, self.tokenizer,
                                   eos_ids(self.spec), self.plans, bar.update)
                for (n, _, _), text in zip(group, out):
                    texts[n] = text
        for request, text in zip(requests, texts):
            self.cache_hook.add_partial("generate_until", request.args, text)
        return texts

    def use_kv(self, **fields):
        """Later requests with these settings changed (kv_policy, hh_ratio, recent_ratio, compress_cache,
        streamed): another policy on the weights already loaded."""
        settings = dataclasses.replace(self.settings, **fields)
        settings.policy(1)
        if self.engine is not None:
            self.engine.use_policy(**{f: v for f, v in fields.items() if f in self.engine.BLOCK_FIELDS})
            self.plans = FixedPlan(self.engine.policy)
        self.settings = settings

    # -- the engine -----------------------------------------------------------------------------
    def _score(self, items: list, what: str, disable_tqdm: bool) -> list:
        check_budgets(self.settings.policy(1), [(i.prompt, i.task) for i in items])
        if not items:
            return []
        engine = self._engine(max(len(i.prompt) for i in items), max(len(i.fed) for i in items))
        with self._progress(len(items), what, disable_tqdm) as bar, torch.no_grad():
            return score(engine, items, self.plans, bar.update)

    def _progress(self, total: int, what: str, disable: bool):
        return progress_bar(total=total, desc=f"flexh2o: {what}", disable=disable)

    def _engine(self, prompt_len: int, gen_len: int):
        """The loaded engine (loaded at the first call, its pre-flight counting this call's longest shape)."""
        if self.engine is None:
            from flexh2o.engine.engine import Engine
            from flexh2o.offload.offload_dir import default_offload_dir
            s = self.settings
            self.engine = Engine.load(
                s.model, policy=s.policy(s.gpu_batch_size), device=s.device, dtype=s.dtype, path=s.path,
                offload_dir=s.offload_dir or default_offload_dir(), seed=s.seed, prompt_len=prompt_len,
                gen_len=gen_len, placement_flag=f"model_args {PERCENT_KEYS}", **s.caps())
            self.plans = FixedPlan(self.engine.policy)
        return self.engine

    def get_model_info(self) -> dict:
        """What lm-eval adds to its results' config: the model, its files' SHA-256, the dtype, flexh2o's version."""
        from flexh2o.host.devices import default_device
        from flexh2o.runs.setup import dtype_name
        s = self.settings
        return {"model": self.spec.name, "model_sha256": model_sha256(self.weights_dir),
                "dtype": dtype_name(s.dtype, s.device or default_device()), "flexh2o_version": version()}

    def close(self):
        if self.engine is not None:
            self.engine.close()
            self.engine = None
