"""Signals: a run stopped by INT, TERM or HUP, once or several times in quick succession, also
while its offload files are being removed, exits with one line and 128 + signum and leaves the
offload dir empty."""

import gc
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import pytest
import torch
from transformers import OPTConfig

from flexh2o.offload import disk, offload_dir
from flexh2o.common import signals
from flexh2o.offload.disk import DiskStore
from flexh2o.offload.tiers import Tiers
from conftest import REPO

INT, TERM, HUP = signal.SIGINT, signal.SIGTERM, signal.SIGHUP


@pytest.fixture(scope="module")
def long_model(tmp_path_factory):
    """A small model with room for 2000 positions: a run of it lasts long enough to be stopped."""
    directory = tmp_path_factory.mktemp("long")
    OPTConfig(vocab_size=128, hidden_size=64, num_hidden_layers=8, ffn_dim=128, num_attention_heads=4,
              max_position_embeddings=2048).save_pretrained(directory)
    return str(directory)


def start_run(model, offload_dir, hup=signal.SIG_DFL, gen_len=2000):
    """The CLI in a child whose SIGHUP is set to `hup` first: not inherited, pytest may run under nohup."""
    launch = (f"import runpy, signal; signal.signal(signal.SIGHUP, signal.{hup.name}); "
              "runpy.run_module('flexh2o.run', run_name='__main__', alter_sys=True)")
    return subprocess.Popen([sys.executable, "-c", launch, "--model", model, "--dummy", "--dtype", "float32",
                             "--prompt-len", "16", "--gen-len", str(gen_len), "--weights", "disk=100",
                             "--cache", "disk=100", "--offload-dir", str(offload_dir)],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for_offload_files(proc, offload_dir, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        runs = [os.path.join(offload_dir, d) for d in os.listdir(offload_dir)]
        if any(len(os.listdir(r)) > 20 for r in runs if os.path.isdir(r)):
            return
        time.sleep(0.05)
    pytest.fail(f"no offload files appeared: {proc.communicate()}")


def storm(proc, first):
    """`first`, then INT, TERM and HUP in turn every few milliseconds until the process is gone:
    some of them land while it removes its offload files."""
    proc.send_signal(first)
    for n in range(100_000):
        time.sleep(0.003)
        if proc.poll() is not None:
            return
        try:
            proc.send_signal((INT, TERM, HUP)[n % 3])
        except ProcessLookupError:
            return


def message_lines(stderr: str) -> list[str]:
    """stderr without the progress bar and the notes that announce the run."""
    return [line for line in re.split(r"[\r\n]", stderr)
            if line.strip() and not line.startswith(("generate:", "note: "))]


# The storm mixes INT, TERM and HUP, so it also covers a SIGTERM right after a Ctrl-C (and a HUP:
# the lone HUP runs in make test-all).
CASES = {"int-int": [INT, INT], "hup": [HUP], "term-then-storm": TERM}


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c == "hup" else c for c in CASES])
def test_signals_in_quick_succession_leave_no_offload_files(long_model, tmp_path, case):
    offload_dir = tmp_path / "off"
    offload_dir.mkdir()
    proc = start_run(long_model, offload_dir)
    try:
        wait_for_offload_files(proc, offload_dir)
        sigs = CASES[case]
        if isinstance(sigs, list):
            for sig in sigs:
                proc.send_signal(sig)
                time.sleep(0.03)
        else:
            storm(proc, sigs)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    # Python runs the handlers of signals pending together in signal-number order: any one sent may be the first.
    sent = set(sigs) if isinstance(sigs, list) else {INT, TERM, HUP}
    assert os.listdir(offload_dir) == []
    assert proc.returncode - 128 in sent, err
    first = signal.Signals(proc.returncode - 128)
    assert "Traceback" not in err
    assert message_lines(err) == [f"stopped by {first.name}: the run was cancelled and its offload files removed"]


def test_a_run_started_with_sighup_ignored_survives_it(long_model, tmp_path):
    """Under nohup a SIGHUP (the terminal closing) must not cancel the run."""
    offload_dir = tmp_path / "off"
    offload_dir.mkdir()
    proc = start_run(long_model, offload_dir, hup=signal.SIG_IGN, gen_len=80)
    try:
        wait_for_offload_files(proc, offload_dir)
        proc.send_signal(HUP)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert os.listdir(offload_dir) == []


@pytest.fixture
def handlers(monkeypatch):
    """The CLI's handlers installed in this process, with fresh state; the old ones put back after."""
    monkeypatch.setattr(signals, "_state", signals._State())
    old = {s: signal.getsignal(s) for s in signals.HANDLED}
    for s in signals.HANDLED:
        signal.signal(s, signals._handle)
    yield
    for s, h in old.items():
        signal.signal(s, h)


def test_a_signal_during_removal_waits_for_it(handlers, tmp_path, monkeypatch):
    store = DiskStore(str(tmp_path / "off"))
    for _ in range(5):
        store.create(4096)
    removed, rmtree = [], shutil.rmtree

    def rmtree_interrupted(path, **kw):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)  # the handler runs here, inside the removal
        removed.append(path)
        rmtree(path, **kw)
    monkeypatch.setattr(disk.shutil, "rmtree", rmtree_interrupted)
    with pytest.raises(signals.Stopped):
        store.close()
    assert removed and not os.path.exists(store.dir)


def test_later_signals_are_only_noted(handlers):
    with pytest.raises(signals.Stopped) as stopped:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(1)
    assert stopped.value.signum == TERM
    os.kill(os.getpid(), signal.SIGINT)  # unwinding: noted, not raised
    time.sleep(0.05)
    assert signals._state.first == TERM


def test_outside_the_cli_a_ctrl_c_during_removal_is_delivered_after_it(tmp_path, monkeypatch):
    """The Python API keeps the process's own handlers: Python's KeyboardInterrupt comes once the files are gone."""
    assert signal.getsignal(INT) is signal.default_int_handler
    store = DiskStore(str(tmp_path / "off"))
    store.create(4096)
    rmtree = shutil.rmtree

    def rmtree_interrupted(path, **kw):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)
        rmtree(path, **kw)
    monkeypatch.setattr(disk.shutil, "rmtree", rmtree_interrupted)
    with pytest.raises(KeyboardInterrupt) as raised:
        store.close()
    assert type(raised.value) is KeyboardInterrupt
    assert not os.path.exists(store.dir)
    assert signal.getsignal(INT) is signal.default_int_handler


def test_a_ctrl_c_while_the_tiers_close_is_delivered_after_the_files_are_gone(tmp_path, monkeypatch):
    """Tiers.close defers signals around DiskStore's removal, which defers them again: the inner
    section must not drop the Ctrl-C the outer one delivers."""
    assert signal.getsignal(INT) is signal.default_int_handler
    tiers = Tiers(torch.device("cpu"), torch.float32, DiskStore(str(tmp_path / "off")), overlap=False)
    tiers.place(torch.ones(4, 4), {"disk": 4})
    rmtree = shutil.rmtree

    def rmtree_interrupted(path, **kw):
        signal.raise_signal(INT)
        rmtree(path, **kw)
    monkeypatch.setattr(disk.shutil, "rmtree", rmtree_interrupted)
    with pytest.raises(KeyboardInterrupt):
        tiers.close()
    assert not (tmp_path / "off").exists()
    assert signal.getsignal(INT) is signal.default_int_handler


def test_a_signal_while_a_store_is_made_leaves_no_folders(handlers, tmp_path, monkeypatch):
    """The signal is held until the store's cleanup is registered, so its folders go with the store."""
    mkdtemp = tempfile.mkdtemp

    def mkdtemp_interrupted(**kw):
        made = mkdtemp(**kw)
        signal.raise_signal(TERM)
        return made
    monkeypatch.setattr(offload_dir.tempfile, "mkdtemp", mkdtemp_interrupted)
    with pytest.raises(signals.Stopped):
        DiskStore(str(tmp_path / "a" / "off"))
    gc.collect()
    assert list(tmp_path.iterdir()) == []


class _LateState(signals._State):
    """A SIGTERM lands just after main() returned, as `closing` is being set."""

    @property
    def closing(self):
        return self.__dict__.get("closing", False)

    @closing.setter
    def closing(self, value):
        if value:
            signal.raise_signal(TERM)
        self.__dict__["closing"] = value


def test_a_signal_after_the_run_returned_keeps_its_exit_code(handlers, monkeypatch, capsys):
    monkeypatch.setattr(signals, "_state", _LateState())
    try:
        code = signals.run_stoppable(lambda: 0)
    except signals.Stopped:  # a KeyboardInterrupt: let through, it would end the whole pytest session
        pytest.fail("the late signal escaped run_stoppable")
    assert code == 0
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("module,sig,after", [("flexh2o.run", INT, 0.3), ("flexh2o.run", TERM, 0.5),
                                              ("flexh2o.run", HUP, 1.0), ("flexh2o.profile", INT, 0.3),
                                              ("flexh2o.plan", TERM, 0.3), ("flexh2o.eval", HUP, 0.3)])
def test_a_signal_while_the_command_starts_is_one_line(module, sig, after):
    """While torch still loads (a second or more here): one line and 128 + signum, no traceback.
    A signal that comes after the run's own handlers took over is one line too."""
    flags = {"flexh2o.profile": ["--quick"], "flexh2o.eval": ["--model", "opt-125m", "--text", "no-such-text.txt"]}
    # Flags that parse: torch loads once they have (--help answers without it).
    p = subprocess.Popen([sys.executable, "-m", module, *flags.get(module, ["--model", "opt-125m"])], cwd=REPO,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(after)
    p.send_signal(sig)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 128 + sig, err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith(f"stopped by {signal.Signals(sig).name}: ")


def stops_once_collected(monkeypatch, capsys, finalizer):
    """run_stoppable(main) where main makes an object whose __del__ is `finalizer` and then waits
    (a minute at most: the stop ends the wait, however busy the machine): it must stop with
    SIGINT's one line and code, no traceback."""
    monkeypatch.setattr(signals, "_state", signals._State())
    monkeypatch.setattr(sys, "unraisablehook", sys.unraisablehook)
    old = {s: signal.getsignal(s) for s in signals.HANDLED}
    collected = type("Collected", (), {"__del__": lambda self: finalizer()})

    def main():
        collected()  # collected at once
        time.sleep(60)
        return 0
    try:
        assert signals.run_stoppable(main) == 128 + INT
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    err = capsys.readouterr().err
    assert "Traceback" not in err and "stopped by SIGINT" in err


def test_a_signal_inside_a_finalizer_still_stops_the_run(monkeypatch, capsys):
    """A finalizer (a progress bar's __del__, collected when the signal comes) swallows what is
    raised inside it: the run must stop all the same, with its one line and no traceback."""
    def signalled():
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)  # the handler runs here, inside the finalizer
    stops_once_collected(monkeypatch, capsys, signalled)


def test_a_signal_while_the_finalizers_stop_is_sent_again_is_only_noted(monkeypatch, capsys):
    """A second signal lands while the hook starts the thread that sends the first one again (a
    storm of signals did, in CI): it must be noted, not raised inside the hook and swallowed there."""
    class SignalledWhileStarting(threading.Timer):
        def start(self):
            signal.raise_signal(TERM)
            super().start()
    monkeypatch.setattr(signals.threading, "Timer", SignalledWhileStarting)
    stops_once_collected(monkeypatch, capsys, lambda: signal.raise_signal(INT))


BUSY_HELPER = """
import argparse, threading, torch
from flexh2o.common.signals import run_command

def busy():  # a helper thread in and out of native code, as a receive from a dead stage returns
    a = torch.randn(600, 600)
    while True:
        a = (a @ a) / 600

def main():
    threading.Thread(target=busy, daemon=True).start()
    (torch.randn(600, 600) @ torch.randn(600, 600)).sum()
    return 1

run_command(argparse.ArgumentParser, main, heavy=())
"""


def test_a_failed_run_with_a_helper_thread_in_native_code_exits_with_its_own_status():
    """Python's shutdown would end that thread with pthread_exit and abort the process (SIGABRT):
    a pipeline stage whose peer failed was seen to."""
    done = subprocess.run([sys.executable, "-c", BUSY_HELPER], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    assert "terminate" not in done.stderr
