"""A server's life: the HTTP side up first (GET /health answers 503, loading), the engine loaded and
served until stopped; stopping is graceful.

uvicorn runs the app on a thread of its own. The engine runs on the thread that loaded it (the
main thread, under the CLI): torch's OpenMP threads spin while they wait for the next operation
only where no more threads compute than there are CPUs, and every thread that has computed keeps
a team of its own, so a model loaded on one thread and run on another ran 9% slower on 2 cores
(its OpenMP threads slept between operations: 61.7 against 67.7 tok/s, medians of 6 interleaved
runs over 24 of scripts/bench_serve.py's prompts). A signal while the weights load unwinds the
loading and removes its offload files, as a run's would; once the engine runs, a signal is only
noted (signals.deferred) and a watching thread stops the server gracefully, the signal raised
once the loop returns.

A stop (a signal or ask_stop() while the engine runs):
1. new requests are refused (503) and /health says "stopping";
2. the batches' records in flight are cancelled (each batch resumes them at the next start) and
   the online requests queued or running go on, for up to `timeout` seconds; then they are cancelled;
3. the engine loop returns; then stop(): uvicorn closes its connections (the answers are out by
   then) and its thread ends; the batches' outputs are closed and the engine removes its offload files.
"""

import logging
import threading
import time

import uvicorn

from flexh2o.common import signals

STEP_WAIT = 0.05  # seconds between looks at whether the running requests have ended
HTTP_GRACE = 5.0  # seconds uvicorn waits for a connection still open after the answers went out

log = logging.getLogger("flexh2o.serve")


class HttpFailed(RuntimeError):
    """uvicorn did not start on the bound socket."""


class Service:
    def __init__(self, state, app, sock):
        self.state, self.sock = state, sock
        config = uvicorn.Config(app, log_config=None, access_log=False, lifespan="off", log_level="warning",
                                timeout_graceful_shutdown=HTTP_GRACE, timeout_keep_alive=30)
        self.http = uvicorn.Server(config)
        self.http_thread = threading.Thread(target=self.http.run, kwargs={"sockets": [sock]}, name="flexh2o http",
                                            daemon=True)
        self.engine = self.loop = None
        self.failed = threading.Event()  # the engine failed: the main thread stops the server
        self.stop_asked = threading.Event()  # stop() asked for from another thread (tests, an embedding program)

    def start_http(self, timeout: float = 30.0):
        self.http_thread.start()
        deadline = time.monotonic() + timeout
        while not self.http.started:
            if not self.http_thread.is_alive() or time.monotonic() > deadline:
                raise HttpFailed(f"the HTTP server did not start within {timeout:g} s")
            time.sleep(0.01)

    def serve(self, engine, loop, files=None, batches=None):
        """The engine is loaded: requests are taken from now on (run() generates them)."""
        self.engine, self.loop = engine, loop
        self.state.loop, self.state.files, self.state.batches = loop, files, batches
        if batches is not None:
            batches.resume_all()
        self.state.status = "ready"

    def engine_failed(self, error: BaseException):
        log.error("error: the engine failed: %s: %s; the server stops", type(error).__name__, error)
        self.state.status = "failed"
        self.failed.set()

    def run(self, timeout: float) -> bool:
        """Runs the engine on this thread until the server is stopped (True) or the engine fails
        (False); `timeout`: the seconds a graceful stop gives the running requests."""
        watcher = threading.Thread(target=self._stop_when_asked, args=(timeout,), name="flexh2o stop watcher",
                                   daemon=True)
        watcher.start()
        with signals.deferred():
            self.loop.run()
        watcher.join()
        return not self.failed.is_set()

    def _stop_when_asked(self, timeout: float):
        while not self.loop.ended.wait(STEP_WAIT):
            if self.stop_asked.is_set() or signals.noted_signal() is not None:
                self._drain(timeout)
                return

    def ask_stop(self):
        self.stop_asked.set()

    def _drain(self, timeout: float):
        """Steps 1 and 2 of a stop: the intake closed, the running requests given `timeout` seconds."""
        if self.state.status != "failed":
            self.state.status = "stopping"
        loop = self.loop
        loop.stop_taking()
        deadline = time.monotonic() + timeout
        while not loop.idle() and time.monotonic() < deadline:
            time.sleep(STEP_WAIT)
        if not loop.idle():
            log.warning("warning: requests still running after --shutdown-timeout %gs: cancelled", timeout)
            loop.cancel_all()

    def stop(self):
        if self.loop is not None:  # (where run() never ran: nothing more is queued)
            self.loop.stop_taking()
        if self.state.status != "failed":
            self.state.status = "stopping"
        self.http.should_exit = True
        if self.http_thread.is_alive():
            self.http_thread.join()
        if self.state.batches is not None:
            self.state.batches.close()
        if self.engine is not None:
            self.engine.close()
        self.sock.close()
