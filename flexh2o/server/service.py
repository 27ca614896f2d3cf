"""A server's life: the HTTP side up first (GET /health answers 503, loading), the engine loaded and
started, then served until stopped; stopping is graceful.

uvicorn runs the app on a thread of its own, so the main thread keeps flexh2o's signal handling
(common/signals.py) through the whole life: a signal while the weights load unwinds the loading
and removes its offload files, as a run's would. stop():

1. new requests are refused (503) and /health says "stopping";
2. the batches' records in flight are cancelled (each batch resumes them at the next start) and
   the online requests queued or running go on, for up to `timeout` seconds; then they are cancelled;
3. uvicorn closes its connections (the answers are out by then) and its thread ends;
4. the engine loop ends, the batches' outputs are closed and the engine removes its offload files.
"""

import logging
import threading
import time

import uvicorn

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
        """The engine is loaded: requests are taken from now on."""
        self.engine, self.loop = engine, loop
        self.state.loop, self.state.files, self.state.batches = loop, files, batches
        loop.start()
        if batches is not None:
            batches.resume_all()
        self.state.status = "ready"

    def engine_failed(self, error: BaseException):
        log.error("error: the engine failed: %s: %s; the server stops", type(error).__name__, error)
        self.state.status = "failed"
        self.failed.set()

    def wait(self) -> bool:
        """Until the engine fails (False) or ask_stop() is called (True); a signal, in the main thread,
        raises out of here."""
        while not (self.failed.wait(0.2) or self.stop_asked.is_set()):
            pass
        return not self.failed.is_set()

    def ask_stop(self):
        self.stop_asked.set()

    def stop(self, timeout: float):
        if self.state.status != "failed":
            self.state.status = "stopping"
        loop = self.loop
        if loop is not None:
            loop.stop_taking()
            deadline = time.monotonic() + timeout
            while not loop.idle() and time.monotonic() < deadline:
                time.sleep(STEP_WAIT)
            if not loop.idle():
                log.warning("warning: requests still running after --shutdown-timeout %gs: cancelled", timeout)
                loop.cancel_all()
        self.http.should_exit = True
        if self.http_thread.is_alive():
            self.http_thread.join()
        if loop is not None:
            loop.join()
        if self.state.batches is not None:
            self.state.batches.close()
        if self.engine is not None:
            self.engine.close()
        self.sock.close()
