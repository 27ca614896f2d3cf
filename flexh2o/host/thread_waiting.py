"""How torch's threads wait for each other, chosen from how busy the machine is as the process starts.

torch's CPU operations and flexh2o's C kernels run on GNU OpenMP's threads. Between two parallel
operations, and at the end of each, a thread that has finished spins (300,000 turns by default)
before it sleeps. On a machine to itself that is the fastest: the next operation starts without a
wake-up. Beside another busy process it is the slowest: a thread stopped by the scheduler holds
the operation back while the others spin on the CPU it needs (a 16-prompt SmolLM2 batch on 2
cores: 28-34 tok/s beside a 2-process hog against 95-123 alone). Waiting passively (sleeping at
once) gave 45-58 beside the hog but 83-92 alone, so it is chosen only for a busy machine
(results/shared_machine.md measures the choice as made).

OpenMP reads its waiting policy once, when torch loads, so the choice is made then: passive where
other processes keep more than BUSY_SHARE of the CPU busy at the start, spinning otherwise. It
applies only where torch is not loaded yet and the user set neither OMP_WAIT_POLICY nor
GOMP_SPINCOUNT (both are kept as given). The thread count itself stays fixed for the run: torch's
products are summed in another order with another count, and a record's tokens must not depend
on the machine's load.
"""

import os
import sys

from flexh2o.host.cpu_load import others_cpu_share  # (torch-free, as this module must be)
from flexh2o.host.hardware import BUSY_SHARE

SAMPLE = 0.05       # seconds the CPU counters are sampled over
USER_SETTINGS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")

chosen: str | None = None  # what choose_waiting() decided: "passive", "spinning", or None (not its choice)
others_share: float | None = None


def choose_waiting(environ=os.environ, modules=sys.modules, measure=lambda: others_cpu_share(SAMPLE)) -> str | None:
    """Sets OMP_WAIT_POLICY=PASSIVE in `environ` where the machine is busy now; returns what was
    chosen, or None where the choice is not flexh2o's (torch already loaded, the user's setting)."""
    global chosen, others_share
    if "torch" in modules or any(name in environ for name in USER_SETTINGS):
        return None
    others_share = measure()
    if others_share is not None and others_share > BUSY_SHARE:
        environ["OMP_WAIT_POLICY"] = "PASSIVE"
        chosen = "passive"
    else:
        chosen = "spinning"
    return chosen


def waiting_note() -> str | None:
    """One line for a command to print where the threads were set to wait passively and a person
    watches (stderr a terminal: what a script reads does not change with the machine's load)."""
    if chosen != "passive" or not sys.stderr.isatty():
        return None
    return (f"note: other processes kept {others_share:.0%} of the CPU busy as this run started: its threads wait "
            "without spinning (OMP_WAIT_POLICY=ACTIVE spins; faster once the machine is quiet)")
