"""Runs a command under a memory budget the kernel enforces: a memory cgroup (v1) of its own.

    run = run_in_budget([sys.executable, "child.py"], 3 * GB, "flexh2o-bench", timeout=600)
    run.oom_killed, run.timed_out, run.peak_bytes, run.returncode
    run.result                                                    # the child's last "RESULT {json}" line
    run.progress                                                  # the number on its last "PROGRESS n" line
    run.lines                                                     # its other stdout lines, each with when it came

The cgroup is made below this process's own memory cgroup (so whatever limits the machine puts on
this process still hold), gets memory.limit_in_bytes (and memory.memsw.limit_in_bytes where swap
is accounted) set to the budget, and the child joins it before it allocates anything: a shell
writes its own pid to cgroup.procs and only then execs the command. Page cache the child reads or
writes is charged to the cgroup too (the kernel reclaims it under pressure before it kills).
An OOM kill (exit by SIGKILL, or the cgroup's oom_kill counter) and a run past its time limit are
reported, not raised. The cgroup is removed afterwards, also on errors, Ctrl-C and (after
exit_on_sigterm()) SIGTERM. When no cgroup can be made (no memory controller, not root),
CgroupUnavailable says why: a benchmark must stop rather than run unlimited.
"""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

RESULT = "RESULT "      # prefix of the line a child prints its result on (one JSON object)
PROGRESS = "PROGRESS "  # prefix of a line with a number saying how far the child got (not echoed)


class CgroupUnavailable(RuntimeError):
    pass


@dataclass
class BudgetRun:
    returncode: int
    oom_killed: bool
    timed_out: bool
    peak_bytes: int       # memory.max_usage_in_bytes: the cgroup's peak (anonymous memory and page cache)
    failcnt: int          # times the cgroup hit its limit (memory or memory+swap; each followed by reclaim, or an OOM kill)
    major_faults: int     # pages its processes had to read back from disk (e.g. code or mapped files it had to drop)
    result: dict | None   # the child's RESULT line, if it printed one
    progress: int | None  # the child's last PROGRESS line, if it printed one
    seconds: float
    lines: list = field(default_factory=list)  # (time.monotonic() it came, line) of every other stdout line


def own_memory_cgroup() -> str:
    """The directory of this process's memory cgroup (cgroup v1)."""
    mount = None
    with open("/proc/mounts") as f:
        for line in f:
            _, where, kind, options = line.split()[:4]
            if kind == "cgroup" and "memory" in options.split(","):
                mount = where
    if mount is None:
        raise CgroupUnavailable("no cgroup v1 memory controller is mounted (see /proc/mounts)")
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            if "memory" in controllers.split(","):
                return os.path.join(mount, path.lstrip("/"))
    raise CgroupUnavailable("this process is in no memory cgroup (/proc/self/cgroup)")


def _write(path: str, value):
    with open(path, "w") as f:
        f.write(str(value))


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _field(path: str, key: str) -> int:
    """The number after `key` in a "key value" per line file such as memory.stat (0 if absent)."""
    for line in _read(path).splitlines():
        if line.startswith(key + " "):
            return int(line.split()[1])
    return 0


def make_cgroup(name: str, limit: int) -> str:
    parent = own_memory_cgroup()
    group = os.path.join(parent, f"{name}-{os.getpid()}-{time.monotonic_ns()}")
    try:
        os.mkdir(group)
    except OSError as e:
        raise CgroupUnavailable(f"cannot create the memory cgroup {group}: {e.strerror} (needs root and a "
                                "writable cgroup v1 memory controller)") from None
    try:
        _write(os.path.join(group, "memory.limit_in_bytes"), limit)  # before memsw: memsw may not go below it
        if os.path.exists(os.path.join(group, "memory.memsw.limit_in_bytes")):
            _write(os.path.join(group, "memory.memsw.limit_in_bytes"), limit)
        if int(_read(os.path.join(group, "memory.limit_in_bytes"))) > limit:
            raise CgroupUnavailable(f"{group} did not take the limit of {limit} bytes")
    except (OSError, CgroupUnavailable) as e:
        remove_cgroup(group)
        raise CgroupUnavailable(f"cannot set the memory limit of {group}: {e}") from None
    return group


def remove_cgroup(group: str):
    """rmdir once the cgroup is empty (a killed child can take a moment to leave it)."""
    for _ in range(100):
        try:
            os.rmdir(group)
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.1)
    print(f"warning: could not remove the cgroup {group}", file=sys.stderr)


def check_available():
    """Raises CgroupUnavailable unless a limited cgroup can be made and removed here."""
    remove_cgroup(make_cgroup("flexh2o-probe", 1 << 30))


def run_in_budget(argv: list[str], limit: int, name: str, timeout: float | None = None) -> BudgetRun:
    """Runs argv inside a fresh cgroup limited to `limit` bytes and echoes its stdout. Past `timeout`
    seconds the child is killed (timed_out): near its limit a cgroup can thrash (re-reading the
    code and mapped files it keeps dropping) for a long time instead of being OOM-killed."""
    group = make_cgroup(name, limit)
    start = time.perf_counter()
    proc, fired = None, []
    try:
        join_then_exec = 'echo $$ > "$0" && exec "$@"'
        proc = subprocess.Popen(["sh", "-c", join_then_exec, os.path.join(group, "cgroup.procs"), *argv],
                                stdout=subprocess.PIPE, text=True, bufsize=1)
        timer = threading.Timer(timeout, lambda: (fired.append(True), proc.kill())) if timeout else None
        if timer:
            timer.start()
        result = progress = None
        lines = []
        for line in proc.stdout:
            if line.startswith(RESULT):
                result = json.loads(line[len(RESULT):])
            elif line.startswith(PROGRESS):
                progress = int(line[len(PROGRESS):])
            else:
                lines.append((time.monotonic(), line))
                print("    " + line, end="", flush=True)
        proc.wait()
        if timer:
            timer.cancel()
        oom_kills = _field(os.path.join(group, "memory.oom_control"), "oom_kill")
        failcnt = max(int(_read(os.path.join(group, f))) for f in ("memory.failcnt", "memory.memsw.failcnt")
                      if os.path.exists(os.path.join(group, f)))
        killed = proc.returncode == -signal.SIGKILL and not fired
        return BudgetRun(proc.returncode, killed or oom_kills > 0, bool(fired),
                         int(_read(os.path.join(group, "memory.max_usage_in_bytes"))), failcnt,
                         _field(os.path.join(group, "memory.stat"), "total_pgmajfault"), result, progress,
                         time.perf_counter() - start, lines)
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        remove_cgroup(group)


def exit_on_sigterm():
    """SIGTERM ends this process through SystemExit, so run_in_budget still kills its child and
    removes the cgroup."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def report_result(result: dict):
    """For the child: hands its result to run_in_budget."""
    print(RESULT + json.dumps(result), flush=True)
