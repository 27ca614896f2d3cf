"""The Python API: Engine.from_pretrained(...) and engine.generate(...)."""

import dataclasses
import weakref
from dataclasses import dataclass

import torch

from flexh2o.common.arguments import shown, switch, text, whole
from flexh2o.offload.disk import DiskStore
from flexh2o.offload.offload_dir import check_offload_dir
from flexh2o.common.messages import progress_bar, say
from flexh2o.compression import int8_activations
from flexh2o.common.errors import UsageError
from flexh2o.kv import make_policy
from flexh2o.host.cpu_limit import fit_threads
from flexh2o.host.devices import default_device, default_dtype, parse_device, parse_dtype
from flexh2o.engine.preflight import (add, capacities, check_fits, load_transient, projected_need, run_need,
                                      weight_need, with_loading)
from flexh2o.models import eos_ids, is_gguf, resolve_model, with_stored_formats
from flexh2o.models.cached_attention import CachedAttention
from flexh2o.engine.generate_arguments import (check_batch, check_generate_arguments, check_positions,
                                               check_refill_arguments, check_token_ids)
from flexh2o.engine.one_call import OneCall, one_call_at_a_time
from flexh2o.engine.pipeline import StageSchedule, check_stage_count, model_slices
from flexh2o.engine.stage_refill import RefillStageSchedule
from flexh2o.engine.policy import Policy
from flexh2o.engine.sampling import MAX_SEED, Sampler, check_seed
from flexh2o.engine.schedule import Schedule
from flexh2o.engine.sequences import Sequences
from flexh2o.engine.slot_pool import SlotPool
from flexh2o.offload.tiers import Tiers
from flexh2o.checkpoints.fingerprint import model_sha256
from flexh2o.checkpoints.weights import CheckpointWeights, DummyWeights, GGUFWeights

@dataclass
class GenerateOutput:
    sequences: torch.Tensor
    scores: list | None = None
    forced_logprobs: torch.Tensor | None = None  # [batch, steps] teacher-forced: log p(forced token)
    greedy: torch.Tensor | None = None            # [batch, steps] teacher-forced: the logits' argmax


@dataclass
class GenerationStats:
    batch_size: int
    prompt_len: int
    gen_len: int          # tokens asked for per sequence
    steps_done: int       # token steps run (fewer than gen_len when every sequence hit EOS)
    prefill_seconds: float
    decode_seconds: float
    compute_seconds: float = 0.0  # forward passes alone
    io_seconds: float = 0.0       # I/O tasks, summed over threads
    disk_bytes_read: int = 0
    step_allocations: list | None = None  # tensors allocated during each token step
    step_dequant_seconds: list | None = None  # dequantizing during each token step, summed over threads
    step_io_tasks: list | None = None  # I/O tasks queued during each token step
    step_handoffs: list | None = None  # hand-offs to the I/O threads during each token step
    step_h2d_bytes: list | None = None  # bytes copied to the compute device during each token step
    finish_seconds: float = 0.0  # after the last token step, until its cache stores were done
    step_seconds: list | None = None  # each token step's seconds, the prompt step first


def act_tier(policy: Policy) -> str:
    if policy.act_gpu_percent == 100:
        return "gpu"
    if policy.act_cpu_percent == 100:
        return "cpu"
    raise UsageError("--act", "activations go whole to one tier: gpu=100 or cpu=100 (disk is not supported)")


class Engine:
    """A model loaded onto the tiers: Engine.from_pretrained(...) loads one, generate() runs a batch."""

    def __init__(self, spec, layers, policy: Policy, tiers: Tiers, weights_source: str, caps: dict,
                 placement_flag: str = "--percent"):
        self.spec, self.layers, self.policy, self.tiers = spec, layers, policy, tiers
        self.weights_source, self.caps, self.placement_flag = weights_source, caps, placement_flag
        self.weight_need = weight_need(layers, tiers.dtype.itemsize, policy, tiers.compute)
        self.load_transient = load_transient(layers, tiers.dtype.itemsize, policy)
        self.last_stats: GenerationStats | None = None
        self.calls = OneCall()
        # An engine dropped without close() closes its tiers (I/O threads, offload files) when it is
        # collected, or at exit; the finalizer holds the tiers, never the engine.
        self._finalizer = weakref.finalize(self, tiers.close)
        self.projected: dict | None = None  # the pre-flight projection per tier of the last generate call
        self.stage = None  # a pipeline stage's (pipeline.py): this process runs a slice of the layers
        self.cache_spec = spec  # the spec whose layer count the cache's pre-flight counts (a stage's slice)
        self.model_sha256: str | None = None  # of the weights' files (fingerprint.py); None for dummy weights
        self.layer_indices = list(range(len(layers)))  # each layer's index in the whole model

    @classmethod
    def from_pretrained(cls, model: str, policy: Policy | None = None, *, path: str | None = None,
                        dummy: bool = False, device=None, dtype=None, offload_dir: str | None = None,
                        gpu_mem: int | None = None, cpu_mem: int | None = None, disk_mem: int | None = None,
                        max_memory: int | None = None, prompt_len: int | None = None, gen_len: int | None = None,
                        seed: int = 0, bypass_page_cache: bool = False, progress: bool = False) -> "Engine":
        """Loads a model and places its weights on the tiers `policy` asks for.

        model: a preset name (opt-1.3b, or its Hugging Face name facebook/opt-1.3b), a local
            Hugging Face checkpoint directory, or a .gguf file.
        policy: batch shape, placement, KV policy and compression (flexh2o.Policy); default Policy().
        path: the preset's weights directory; not needed for a directory or .gguf model.
        dummy: deterministic random weights of the model's real size instead of reading any.
        device: "cuda", "cuda:N" or "cpu" (default: cuda when torch sees one).
        dtype: torch.float16, torch.bfloat16 or torch.float32, or their names (default: float16 on
            CUDA, float32 on a CPU: host/devices.py's default_dtype).
        offload_dir: the directory under which tensors placed on disk go, in a fresh sub-directory
            removed by close(); needed when the policy puts anything on disk.
        gpu_mem, cpu_mem, disk_mem: bytes each tier may use (default: what is free), and
        max_memory: bytes the whole process may use. A policy that does not fit is refused with
            a UsageError before anything is allocated.
        prompt_len, gen_len: when given, that pre-flight check also covers the KV cache and
            activations of a job of these lengths.
        seed: the seed of dummy weights.
        bypass_page_cache: read weights and cache from disk with O_DIRECT.
        progress: a progress bar while loading.

        Use the engine in a with-block, or call close(), to end its I/O threads and remove its
        offload files."""
        return cls.load(model, policy, path=path, dummy=dummy, device=device, dtype=dtype, offload_dir=offload_dir,
                        gpu_mem=gpu_mem, cpu_mem=cpu_mem, disk_mem=disk_mem, max_memory=max_memory,
                        prompt_len=prompt_len, gen_len=gen_len, seed=seed, bypass_page_cache=bypass_page_cache,
                        progress=progress)

    @classmethod
    def load(cls, model: str, policy: Policy | None = None, *, path: str | None = None, dummy: bool = False,
             device=None, dtype=None, offload_dir: str | None = None, gpu_mem: int | None = None,
             cpu_mem: int | None = None, disk_mem: int | None = None, max_memory: int | None = None,
             prompt_len: int | None = None, gen_len: int | None = None, seed: int = 0,
             bypass_page_cache: bool = False, progress: bool = False, placement_flag: str = "--percent",
             before_loading=None, stage=None, growth=None) -> "Engine":
        """from_pretrained for flexh2o's own commands, with what they add: `placement_flag`, the
        flag a policy that does not fit is blamed on (the command line's placement flags);
        `before_loading()`, run once the pre-flight passed (the command line's note of what goes
        where); `stage`, a pipeline Stage whose slice of the layers alone is loaded (pipeline.py);
        `growth`, what the pre-flight allows the process beyond its projection (host/process_memory.py's
        Growth; default: the local profile's calibration), none for the memory probe that measures it."""
        if policy is not None and not isinstance(policy, Policy):
            raise UsageError("policy", f"must be a flexh2o.Policy (or None: the default one), got {shown(policy)}")
        policy = policy or Policy()
        whole("seed", seed, 0, MAX_SEED)
        text("offload_dir", offload_dir, none=True)
        for name, value in (("dummy", dummy), ("progress", progress), ("bypass_page_cache", bypass_page_cache)):
            switch(name, value)
        device = parse_device(device or default_device())
        dtype = parse_dtype(dtype) if dtype is not None else default_dtype(device)
        act_tier(policy)
        spec, weights_dir = resolve_model(model, path)
        check_seed(seed)
        if dummy:
            source = DummyWeights(seed)
        elif weights_dir is None:
            raise UsageError("--path", f"{spec.name} needs its weights: give path=DIR (--path) or dummy=True (--dummy)")
        else:
            source = GGUFWeights(weights_dir) if is_gguf(weights_dir) else \
                CheckpointWeights(weights_dir, "--path" if weights_dir == path else "--model")
        spec = with_stored_formats(spec, source.stored_formats() if hasattr(source, "stored_formats") else ())
        note = int8_activations.check(device.type, dtype, spec.stored_formats) if policy.int8_activations else None
        if note is not None:
            say(f"note: {note}")
        layers, indices, cache_spec = spec.build_layers(), None, spec
        if stage is not None:
            check_stage_count(stage.count, spec)
            indices = model_slices(layers, dtype.itemsize, stage.count)[stage.index]
            layers = [layers[j] for j in indices]
            cache_spec = dataclasses.replace(spec, num_layers=sum(isinstance(la, CachedAttention) for la in layers))
        source.check([s for layer in layers for s in layer.weight_specs()])
        uses_disk = policy.disk_percent("w") > 0 or policy.disk_percent("cache") > 0
        if uses_disk and offload_dir is None:
            raise UsageError("--offload-dir", "the policy puts tensors on disk: give an offload directory")
        if uses_disk:
            check_offload_dir(offload_dir)
        fit_threads()  # before the pre-flight, whose projection depends on the thread count
        caps = capacities(device, offload_dir if uses_disk else None, gpu_mem, cpu_mem, disk_mem, max_memory,
                          str(dtype).removeprefix("torch."), growth)
        if prompt_len and gen_len:
            need = projected_need(cache_spec, layers, policy, dtype.itemsize, prompt_len, gen_len, device)
        else:
            none = {"gpu": 0, "cpu": 0, "disk": 0}
            need = with_loading(weight_need(layers, dtype.itemsize, policy, device), none,
                                load_transient(layers, dtype.itemsize, policy), device.type == "cuda")
        check_fits(need, caps, device, placement_flag)
        digest = None if dummy else model_sha256(weights_dir)
        if before_loading is not None:
            before_loading()
        disk = DiskStore(offload_dir, bypass_page_cache, flush_writes=caps["limit"] is not None) if uses_disk else None
        tiers = Tiers(device, dtype, disk, overlap=policy.overlap, int8_activations=policy.int8_activations)
        try:
            prefetch = getattr(source, "prefetch", lambda names: None)
            with progress_bar(layers, desc="load weights", unit="layer", disable=not progress, leave=False) as bar:
                for i, layer in enumerate(bar):
                    # The disk reads the next two layers while this one is quantized and written (one
                    # ahead left it idle part of the time: OPT-1.3B from a float16 checkpoint not in the
                    # page cache); each is asked for once.
                    ahead = layers[i + 1: i + 3] if i == 0 else layers[i + 2: i + 3]
                    prefetch([name for after in ahead for name, _ in after.weight_specs()])
                    layer.init_weight(source, tiers, policy)
            tiers.finish_placing()
            tiers.sync()  # weights placed on the device are written before a caller's own stream reads them
        except BaseException:
            tiers.close()
            raise
        engine = cls(spec, layers, policy, tiers, source.describe(), caps, placement_flag)
        engine.stage, engine.cache_spec, engine.model_sha256 = stage, cache_spec, digest
        engine.layer_indices = list(indices) if indices is not None else list(range(len(layers)))
        return engine

    # What may change between generate calls on a loaded engine: all but the weights' placement.
    BLOCK_FIELDS = ("gpu_batch_size", "num_gpu_batches", "cache_gpu_percent", "cache_cpu_percent", "act_gpu_percent",
                    "act_cpu_percent", "cpu_cache_compute", "kv_policy", "hh_ratio", "recent_ratio", "compress_cache")

    def use_policy(self, **fields):
        """Runs later generate calls with these BLOCK_FIELDS changed (a dataset job's block shapes,
        another KV policy); the weights stay as placed."""
        unknown = set(fields) - set(self.BLOCK_FIELDS)
        if unknown:
            raise ValueError(f"only {', '.join(self.BLOCK_FIELDS)} can change on a loaded engine, "
                             f"not {sorted(unknown)}")
        policy = dataclasses.replace(self.policy, **fields)
        act_tier(policy)
        if policy.disk_percent("cache") > 0 and self.tiers.disk is None:
            raise UsageError("--cache", "this engine was loaded without an offload directory: the cache cannot "
                             "go to disk")
        self.policy = policy

    def close(self):
        """Removes this engine's offload files and stops its I/O threads (waiting for a generate
        call another thread is running)."""
        self.calls.close(self._finalizer)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _run(self, seqs, prompt_len: int, gen_len: int, steps: int, seed, progress: bool):
        """Runs up to `steps` token steps of `seqs` over caches sized for prompt_len + gen_len tokens
        per sequence; notes their figures in last_stats."""
        policy, spec = self.policy, self.spec
        batch_sizes = [policy.gpu_batch_size] * policy.num_gpu_batches
        io_before, read_before = self.tiers.io_seconds, self.tiers.disk.bytes_read if self.tiers.disk else 0
        try:
            self.tiers.reserve_loads(self.layers)
            for j, layer in zip(self.layer_indices, self.layers):
                layer_seed = ((0 if seed is None else seed) * 100_003 + j) % (1 << 63)
                layer.init_cache(batch_sizes, make_policy(policy, prompt_len, gen_len, layer_seed), policy,
                                 refills=seqs.refills)
            if self.stage is None:
                schedule = Schedule(self.layers, seqs, policy.num_gpu_batches, self.tiers, act_tier(policy))
                schedule.use_whole_steps()
            else:
                kind = RefillStageSchedule if seqs.refills else StageSchedule
                schedule = kind(self.layers, seqs, policy.num_gpu_batches, self.tiers, act_tier(policy),
                                self.stage, policy.gpu_batch_size, spec.hidden_size, prompt_len)
            with torch.no_grad():
                steps_done = schedule.run(steps, progress)
            if self.tiers.failure is not None:  # an I/O task failed that nothing waited for
                raise self.tiers.failure
        except BaseException as error:
            self.tiers.abandon(error)
            raise
        finally:
            self.tiers.settle()
            for layer in self.layers:  # after a failure nothing is running any more, and nothing is waited for
                layer.free_cache()
            self.tiers.clear_pool()
        times = schedule.step_seconds
        read = (self.tiers.disk.bytes_read if self.tiers.disk else 0) - read_before
        self.last_stats = GenerationStats(policy.batch_size, prompt_len, gen_len, steps_done,
                                          schedule.prefill_seconds, schedule.decode_seconds, schedule.compute_seconds,
                                          self.tiers.io_seconds - io_before, read, schedule.step_allocations,
                                          schedule.step_dequant_seconds, schedule.step_io_tasks,
                                          schedule.step_handoffs, schedule.step_h2d_bytes, schedule.finish_seconds,
                                          list(times))

    @one_call_at_a_time
    def generate_refilled(self, requests, on_done, prompt_len: int, gen_len: int, do_sample: bool = False,
                          temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                          eos_token_id: int | None = -1, pad_token_id: int | None = None,
                          join_every: int = 1, prompt_chunk: int | None = None, wait_for_work=None,
                          on_step=None) -> SlotPool:
        """Generates every request of `requests` (an iterator of slot_pool.Request) in the policy's
        batch of slots, a stopped sequence's slot taking the next request (continuous batching).

        on_done(request, tokens, reason) receives each one as it stops: its new token ids (ending
        with the EOS token where one ended it) and "stop" or "length". prompt_len and gen_len: the
        longest prompt and the largest max_new_tokens among the requests, which size each slot's
        cache (and the pre-flight). join_every: free slots take new requests every this many token
        steps. prompt_chunk: a longer prompt joins this many tokens per token step (full cache,
        uncompressed; None: whole). Sampling as generate's, each request from its own seed (and with
        its own sampler where it brings one). wait_for_work: where given, called when nothing runs and
        nothing waits, returning once a request may wait (True) or to end the run (False): the run
        then lasts as long as its caller wants (a server). on_step: called as each token step ends.
        Returns the pool, whose counts say how it went; last_stats holds the run's times."""
        policy, spec = self.policy, self.spec
        check_generate_arguments(spec.vocab_size, do_sample, temperature, top_k, top_p, None, eos_token_id,
                                 pad_token_id, False, False, None)
        check_refill_arguments(policy, join_every, prompt_chunk)
        check_positions(prompt_len, gen_len, spec)
        need = run_need(self.cache_spec, policy, self.tiers.dtype.itemsize, prompt_len, gen_len, self.tiers.compute,
                        False, self.tiers.io_threads)
        self.projected = add(self.weight_need, need)
        check_fits(self.projected, self.caps, self.tiers.compute, self.placement_flag)
        eos = eos_ids(spec) if eos_token_id == -1 else eos_token_id
        pad = spec.pad_token_id if pad_token_id is None else pad_token_id
        pool = SlotPool(requests, policy.batch_size, policy.gpu_batch_size,
                        Sampler(do_sample, temperature, top_k, top_p, 0), eos, pad, self.tiers.compute, on_done,
                        join_every, prompt_chunk, wait_for_work, on_step)
        self._run(pool, prompt_len, gen_len, 1 << 62, None, False)
        return pool

    @one_call_at_a_time
    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 max_new_tokens: int = 32, do_sample: bool = False, temperature: float = 1.0,
                 top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
                 eos_token_id: int | None = -1, pad_token_id: int | None = None,
                 output_scores: bool = False, progress: bool = False, forced_tokens: torch.Tensor | None = None,
                 row_seeds: list | None = None, row_max_new_tokens: list | None = None, stop_check=None):
        """Generates for a left-padded batch of token ids; calls from several threads run one at a time.

        input_ids: [gpu_batch_size * num_gpu_batches, prompt_len] token ids, padding on the left.
        attention_mask: 1 for real tokens, 0 for padding (default: all real).
        max_new_tokens: tokens to generate per sequence.
        do_sample, temperature, top_k, top_p: sampling (default greedy); top_k 0 and top_p 1 turn
            those filters off.
        seed: the sampling seed of this call (default: a fresh random one); it also seeds Keyformer's noise.
        eos_token_id: the token that ends a sequence; -1 (default) is the model's own, None never
            stops early. A finished sequence continues with pad_token_id (default: the model's).
        output_scores: return a GenerateOutput whose scores hold one [batch, vocab] float32 tensor
            of logits per generated token, instead of the ids alone.
        progress: a progress bar over the token steps.
        forced_tokens: [batch, max_new_tokens] ids for teacher forcing: step i feeds
            forced_tokens[:, i] next (no EOS stop); the GenerateOutput then holds the
            log-probability each step gave its forced token, and its greedy choice (perplexity,
            lm-eval's log-likelihoods).
        row_seeds: a sampling seed per sequence (each draws from its own generator, so its tokens
            do not depend on its batch); row_max_new_tokens: tokens per sequence at most.
        stop_check(row, tokens): called after each step with a running sequence's new tokens so
            far; True ends it as EOS does (stop strings).

        Returns the ids [batch, prompt_len + max_new_tokens], or a GenerateOutput (output_scores).
        """
        policy, spec = self.policy, self.spec
        check_generate_arguments(spec.vocab_size, do_sample, temperature, top_k, top_p, seed, eos_token_id,
                                 pad_token_id, output_scores, progress, stop_check)
        attention_mask = check_batch(input_ids, attention_mask, policy.batch_size, spec.vocab_size)
        prompt_len = input_ids.shape[1]
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int):
            raise UsageError("max_new_tokens", f"must be a whole number, got {max_new_tokens!r}")
        if max_new_tokens < 1:
            raise UsageError("--gen-len", f"must be at least 1, got {max_new_tokens}")
        check_positions(prompt_len, max_new_tokens, spec)
        need = run_need(self.cache_spec, policy, self.tiers.dtype.itemsize, prompt_len, max_new_tokens,
                        self.tiers.compute, output_scores, self.tiers.io_threads)
        self.projected = add(self.weight_need, need)
        check_fits(self.projected, self.caps, self.tiers.compute, self.placement_flag)
        if forced_tokens is not None:
            check_token_ids("forced_tokens", forced_tokens, spec.vocab_size)
            if tuple(forced_tokens.shape) != (input_ids.shape[0], max_new_tokens):
                raise UsageError("forced_tokens", f"must be [batch, max_new_tokens] = [{input_ids.shape[0]}, "
                                 f"{max_new_tokens}], got {list(forced_tokens.shape)}")
        for name, rows in (("row_seeds", row_seeds), ("row_max_new_tokens", row_max_new_tokens)):
            if rows is not None and len(rows) != input_ids.shape[0]:
                raise UsageError(name, f"must give one value per sequence ({input_ids.shape[0]}), got {len(rows)}")
        sampler = Sampler(do_sample, temperature, top_k, top_p, seed, row_seeds)
        eos = None if forced_tokens is not None else eos_ids(spec) if eos_token_id == -1 else eos_token_id
        pad = spec.pad_token_id if pad_token_id is None else pad_token_id
        seqs = Sequences(input_ids.cpu().long(), attention_mask.cpu(), max_new_tokens, policy.gpu_batch_size,
                         sampler, eos, pad, output_scores, self.tiers.compute,
                         None if forced_tokens is None else forced_tokens.cpu().long(), row_max_new_tokens, stop_check)
        self._run(seqs, prompt_len, max_new_tokens, max_new_tokens, seed, progress)
        chose = self.stage is None or self.stage.is_last  # scores exist where the LM head ran
        scores = seqs.score_list(self.last_stats.steps_done) if output_scores and chose else None
        if forced_tokens is not None:
            return GenerateOutput(seqs.ids, scores, seqs.forced_logprobs if chose else None,
                                  seqs.greedy if chose else None)
        if output_scores:
            return GenerateOutput(seqs.ids, scores)
        return seqs.ids
