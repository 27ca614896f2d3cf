"""What `python -m flexh2o.serve` does once its flags are parsed (serve.py keeps the parser free of
torch): checks, the plan, the socket, the HTTP side, loading, serving, and the graceful stop.

The server's rows are sized once for --max-model-len N tokens: a row's cache holds N tokens (an
evicting policy: the budget of an N - 1 token prompt), and any sequence of at most N tokens
fits. Without a batch or placement the cost model plans for prompts of N/2 tokens generating
N/2 (an evicting policy: prompts of N - 1), a cache of the same size.
"""

import ipaddress
import logging
import os
import socket
import sys

import torch

from flexh2o.checkpoints.fingerprint import model_sha256
from flexh2o.common.errors import UsageError
from flexh2o.common.messages import say
from flexh2o.common.names import DEFAULT_MAX_MODEL_LEN
from flexh2o.common.signals import set_stop_outcome
from flexh2o.common.version import version
from flexh2o.engine.generate_arguments import check_refill_arguments
from flexh2o.engine.policy import Policy, placement_flag, policy_percents
from flexh2o.engine.preflight import parse_size
from flexh2o.host.devices import default_device, parse_device, parse_dtype
from flexh2o.host.thread_waiting import waiting_note
from flexh2o.models import eos_ids, resolve_model
from flexh2o.offload.disk import OffloadError
from flexh2o.offload.io_tasks import IOTaskError
from flexh2o.offload.offload_dir import check_offload_dir
from flexh2o.runs.auto_plan import DEFAULT_GPU_BATCH_SIZE, check_planning_flags
from flexh2o.runs.prompts import load_tokenizer
from flexh2o.runs.setup import choose_policy, dtype_name, load_engine
from flexh2o.server.app import ServerState, build_app
from flexh2o.server.batches import BatchStore
from flexh2o.server.engine_loop import EngineLoop
from flexh2o.server.files import FileStore
from flexh2o.server.metrics import Metrics
from flexh2o.server.openai_requests import Context
from flexh2o.server.service import HttpFailed, Service
from flexh2o.server.state_dir import StateDir
from flexh2o.server.tokenizer import SharedTokenizer

STRING_FLAGS = ("model", "path", "served_model_name", "weights", "cache", "act", "gpu_mem", "cpu_mem", "disk_mem",
                "max_memory", "device", "dtype", "offload_dir", "host", "api_key", "state_dir")


def serve_parsed(args, on_ready=None) -> int:
    """The server of parsed flags, its errors as one line and an exit status. on_ready(service, url):
    called once it serves (the service's ask_stop() then stops it from another thread)."""
    try:
        with torch.no_grad():
            return serve(args, on_ready)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (OffloadError, IOTaskError) as e:
        cause = f"--offload-dir: {e.strerror}" if isinstance(e, OffloadError) else str(e)
        print(f"error: {cause}; the server stopped and its offload files were removed", file=sys.stderr)
        return 1
    except HttpFailed as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


def check_flags(args):
    for name in STRING_FLAGS:
        value = getattr(args, name)
        if value is not None and not value.strip():
            raise UsageError(f"--{name.replace('_', '-')}", "is empty; give a value or leave the flag out")
    for flag, value, low in (("--max-queued", args.max_queued, 1), ("--join-every", args.join_every, 1),
                             ("--port", args.port, 0), ("--max-model-len", args.max_model_len or 2, 2)):
        if value < low or (flag == "--port" and value > 65535):
            raise UsageError(flag, f"must be a whole number {'in 0..65535' if flag == '--port' else f'>= {low}'}, "
                             f"got {value}")
    if not 0 <= args.shutdown_timeout < float("inf"):
        raise UsageError("--shutdown-timeout", f"must be a number of seconds >= 0, got {args.shutdown_timeout}")


def api_key(args) -> str | None:
    """The key clients must send; refuses to serve a non-loopback address without one unless told."""
    key = args.api_key if args.api_key is not None else os.environ.get("FLEXH2O_API_KEY") or None
    if key is None and not args.no_api_key and not is_loopback(args.host):
        raise UsageError("--host", f"{args.host} can be reached from other machines: give --api-key KEY (or set "
                         "FLEXH2O_API_KEY), or --no-api-key to serve it without a key on purpose")
    return key


def is_loopback(host: str) -> bool:
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)}
    except socket.gaierror:
        return False
    return bool(addresses) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses)


def bind(host: str, port: int) -> socket.socket:
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        raise UsageError("--host", f"cannot resolve {host!r}: {e.strerror}") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise UsageError("--port", f"cannot listen on {host}:{port}: {e.strerror}") from None
    sock.set_inheritable(False)
    return sock


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://{f'[{host}]' if ':' in host else host}:{port}"


def serve(args, on_ready=None) -> int:
    check_flags(args)
    key = api_key(args)
    limits = (parse_size(args.max_body_size, "--max-body-size"), parse_size(args.max_upload_size, "--max-upload-size"))
    planning = args.gpu_batch_size is None and placement_flag(args) is None
    args.batch = args.prompts_file = None  # (the planner's one-block inputs)
    check_planning_flags(args, planning)
    w_gpu, w_cpu, c_gpu, c_cpu, a_gpu, a_cpu = policy_percents(args)
    policy = Policy(args.gpu_batch_size or DEFAULT_GPU_BATCH_SIZE, args.num_gpu_batches or 1, w_gpu, w_cpu, c_gpu,
                    c_cpu, a_gpu, a_cpu, overlap=args.overlap, cpu_cache_compute=args.cpu_cache_compute,
                    kv_policy=args.kv_policy, hh_ratio=args.hh_ratio, recent_ratio=args.recent_ratio,
                    compress_weight=args.compress_weight, compress_cache=args.compress_cache,
                    int8_activations=args.int8_activations)
    check_refill_arguments(policy, args.join_every, args.prompt_chunk)
    caps = {f"{t}_mem": parse_size(getattr(args, f"{t}_mem"), f"--{t}-mem")
            for t in ("gpu", "cpu", "disk") if getattr(args, f"{t}_mem") is not None}
    if args.max_memory is not None:
        caps["max_memory"] = parse_size(args.max_memory, "--max-memory")
    device = parse_device(args.device or default_device())
    dtype = parse_dtype(args.dtype) if args.dtype else None
    spec, weights_dir = resolve_model(args.model, args.path)
    tokenizer = load_tokenizer(weights_dir)
    if tokenizer is None:
        raise UsageError("--model", "the server needs a tokenizer: give a GGUF file, or a directory (--model, or "
                         "--path for a preset) with tokenizer files")
    n = args.max_model_len or min(spec.max_positions, DEFAULT_MAX_MODEL_LEN)
    if n > spec.max_positions:
        raise UsageError("--max-model-len", f"{spec.name} has {spec.max_positions} positions, got {n}")
    if args.offload_dir is not None:
        check_offload_dir(args.offload_dir)
    if waiting_note() is not None:
        say(waiting_note())
    state_dir = StateDir(args.state_dir) if args.state_dir else None
    try:
        return run_server(args, key, limits, planning, policy, caps, device, dtype, spec, weights_dir,
                          SharedTokenizer(tokenizer), n, state_dir, on_ready)
    finally:
        if state_dir is not None:
            state_dir.close()


def run_server(args, key, limits, planning, policy, caps, device, dtype, spec, weights_dir, tokenizer, n: int,
               state_dir, on_ready=None) -> int:
    full = policy.kv_policy == "full"
    args.prompt_len, args.gen_len = (n // 2, n - n // 2) if full else (n - 1, n - n // 2)
    policy, profile = choose_policy(args, policy, spec, device, dtype, caps, planning)
    args.prompt_len, args.gen_len = n - 1, 1  # every row's cache: the whole of the longest sequence
    sock = bind(args.host, args.port)
    name = args.served_model_name or spec.name
    eos = eos_ids(spec)
    metrics = Metrics(policy.batch_size)
    state = ServerState(Context(tokenizer, name, n, spec.vocab_size), eos, metrics, args.log_prompts)
    service = Service(state, build_app(state, key, *limits), sock)
    logging.basicConfig(format="%(asctime)s %(message)s", level=logging.WARNING if args.quiet else logging.INFO,
                        stream=sys.stderr)
    set_stop_outcome(lambda: f"the server stopped ({metrics_total(metrics)} requests answered)")
    try:
        service.start_http()
        url = url_of(sock)
        print(f"note: loading {spec.name}; {url}/health answers 503 until it is ready", file=sys.stderr, flush=True)
        engine = load_engine(args, spec, policy, device, dtype, caps, args.dummy, profile)
        files = batches = None
        loop = EngineLoop(engine, n - 1, 1, eos, args.max_queued, args.join_every, args.prompt_chunk, metrics,
                          service.engine_failed)
        if state_dir is not None:
            files = FileStore(state_dir.files)
            settings = {"model": spec.name, "model_sha256": model_sha256(weights_dir),
                        "dtype": dtype_name(dtype, device),
                        "kv_policy": policy.kv_policy, "hh_ratio": policy.hh_ratio,
                        "recent_ratio": policy.recent_ratio, "compress_weight": policy.compress_weight,
                        "compress_cache": policy.compress_cache, "max_model_len": n, "seed": args.seed}
            batches = BatchStore(state_dir.batches, files, loop, (tokenizer, state.engine_tokenizer), eos, name,
                                 settings, n, args.seed)
        service.serve(engine, loop, files, batches)
        print(f"flexh2o {version()} serving {name} at {url}/v1 ({policy.batch_size} rows of {n} tokens; Ctrl-C "
              "stops)", flush=True)
        if on_ready is not None:
            on_ready(service, url)
        return 0 if service.run(args.shutdown_timeout) else 1  # (a failed engine's line is logged)
    finally:
        service.stop()


def metrics_total(metrics) -> int:
    return int(sum(sample.value for family in metrics.requests.collect() for sample in family.samples
                   if sample.name.endswith("_total")))
