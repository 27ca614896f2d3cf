"""OpenMP's waiting is chosen once, before torch loads: passive on a machine other processes keep
busy, spinning on a quiet one; never where torch is already loaded or the user set it."""

import subprocess
import sys

import flexh2o.host.thread_waiting as waiting
from conftest import REPO


def test_a_busy_machine_makes_the_threads_wait_passively(monkeypatch):
    monkeypatch.setattr(waiting, "chosen", None)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    environ = {}
    assert waiting.choose_waiting(environ, {}, lambda: 0.5) == "passive"
    assert environ == {"OMP_WAIT_POLICY": "PASSIVE"}
    note = waiting.waiting_note()
    assert note.startswith("note: other processes kept 50% of the CPU busy") and "OMP_WAIT_POLICY=ACTIVE" in note


def test_a_quiet_machine_keeps_the_spinning(monkeypatch):
    monkeypatch.setattr(waiting, "chosen", None)
    environ = {}
    assert waiting.choose_waiting(environ, {}, lambda: waiting.BUSY_SHARE / 2) == "spinning"
    assert environ == {} and waiting.waiting_note() is None
    assert waiting.choose_waiting(environ, {}, lambda: None) == "spinning"  # unknown: as quiet


def test_the_note_is_for_a_terminal_only(monkeypatch):
    monkeypatch.setattr(waiting, "chosen", None)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
    assert waiting.choose_waiting({}, {}, lambda: 0.9) == "passive" and waiting.waiting_note() is None


def test_the_users_setting_and_a_loaded_torch_are_left_alone(monkeypatch):
    monkeypatch.setattr(waiting, "chosen", None)
    for setting in waiting.USER_SETTINGS:
        environ = {setting: "1000"}
        assert waiting.choose_waiting(environ, {}, lambda: 0.9) is None and environ == {setting: "1000"}
    environ = {}
    assert waiting.choose_waiting(environ, {"torch": sys}, lambda: 0.9) is None and environ == {}
    assert waiting.waiting_note() is None


def test_the_share_is_read_from_the_cpu_counters():
    from flexh2o.host import cpu_load
    assert 0.0 <= cpu_load.others_cpu_share(0.02)
    every, own = cpu_load.cpu_seconds()
    assert every >= 0 and own >= 0


def test_importing_flexh2o_first_decides_before_torch_loads():
    code = ("import os, sys, flexh2o, flexh2o.host.thread_waiting as w; "
            "assert 'torch' not in sys.modules; "
            "print(w.chosen, os.environ.get('OMP_WAIT_POLICY') == ('PASSIVE' if w.chosen == 'passive' else None))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120,
                          env={k: v for k, v in __import__("os").environ.items() if k not in waiting.USER_SETTINGS})
    assert done.returncode == 0, done.stderr
    chosen, consistent = done.stdout.split()
    assert chosen in ("passive", "spinning") and consistent == "True"
