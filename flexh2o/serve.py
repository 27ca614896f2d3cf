"""Command line: python -m flexh2o.serve --model MODEL [engine flags] [--host 127.0.0.1 --port 8000]

Serves the model over OpenAI's HTTP API (completions, chat completions, the Files and Batch APIs)
until SIGINT or SIGTERM; every request joins the same pool of refilled slots. See docs/serve.md.
"""

if __name__ == "__main__":  # first, before torch loads: a signal while it does is one line too
    from flexh2o.common.signals import stop_at_once
    stop_at_once()

import argparse

from flexh2o.common.errors import OneLineErrorParser
from flexh2o.common.names import DEFAULT_MAX_MODEL_LEN, add_engine_flags, add_model_flags


def build_parser() -> argparse.ArgumentParser:
    p = OneLineErrorParser(prog="python -m flexh2o.serve", description=__doc__.split("\n\n")[1].strip())
    add_model_flags(p, default=None)
    p.add_argument("--served-model-name", metavar="NAME",
                   help="the model's name in the API (default: the model file's or directory's name)")
    p.add_argument("--max-model-len", type=int, default=None, metavar="N",
                   help="tokens of one sequence, prompt and generated: every row's KV cache holds this many (an "
                        f"evicting policy: the budget of a prompt this long) (default: the model's positions, at most "
                        f"{DEFAULT_MAX_MODEL_LEN})")
    add_engine_flags(p)
    p.add_argument("--seed", type=int, default=0, metavar="N",
                   help="seed of a batch record's sampling where it gives none (with its custom_id), and of dummy "
                        "weights")
    p.add_argument("--join-every", type=int, default=1, metavar="N",
                   help="free rows take waiting sequences every N token steps (default 1)")
    p.add_argument("--prompt-chunk", type=int, default=None, metavar="N",
                   help="a prompt longer than N tokens joins N of them per token step, so that the others' tokens "
                        "keep coming (full cache, uncompressed; default: whole prompts)")
    http = p.add_argument_group("HTTP")
    http.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1, this machine "
                      "alone; another address needs --api-key or --no-api-key)")
    http.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000; 0: any free one)")
    http.add_argument("--api-key", metavar="KEY", help="clients must send 'Authorization: Bearer KEY' (default: "
                      "$FLEXH2O_API_KEY if set)")
    http.add_argument("--no-api-key", action="store_true",
                      help="serve an address other than loopback without an API key, on purpose")
    http.add_argument("--max-queued", type=int, default=256, metavar="N",
                      help="online sequences (a request's choices) that may wait for a row; beyond, 429 (default 256)")
    http.add_argument("--max-body-size", default="16MB", metavar="SIZE",
                      help="largest request body (default 16MB)")
    http.add_argument("--max-upload-size", default="512MB", metavar="SIZE",
                      help="largest file uploaded to /v1/files (default 512MB)")
    http.add_argument("--state-dir", metavar="DIR",
                      help="where the Files and Batch APIs keep their files; a batch resumes from there when the "
                           "server starts again (default: none, and no Batch API)")
    http.add_argument("--shutdown-timeout", type=float, default=30.0, metavar="SECONDS",
                      help="on SIGINT/SIGTERM, how long running requests may take to finish before they are "
                           "cancelled (default 30)")
    http.add_argument("--log-prompts", action="store_true", help="log each request's prompt with its line")
    http.add_argument("--quiet", action="store_true", help="no line per request (warnings and errors only)")
    p.add_argument("--verbose", action="store_true", help="a progress bar while the weights load")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from flexh2o.server.command import serve_parsed  # torch loads once the flags parsed: --help answers at once
    return serve_parsed(args)


SERVE_PACKAGES = ("starlette", "uvicorn", "multipart", "prometheus_client")


def missing_packages() -> list[str]:
    import importlib.util
    return [name for name in SERVE_PACKAGES if importlib.util.find_spec(name) is None]


if __name__ == "__main__":
    import sys
    if missing_packages():
        build_parser().parse_args()  # (--help still answers)
        print(f"error: flexh2o.serve needs {', '.join(missing_packages())}: pip install 'flexh2o[serve]'",
              file=sys.stderr)
        sys.exit(2)
    from flexh2o.common.signals import run_command
    run_command(build_parser, main, heavy=("flexh2o.server.command",))
