"""A check made of sections that cannot cost its figures: what `make gpu-check` runs on a GPU lent
for half an hour.

Each section runs in its own try/except, within a time budget: a section is skipped (and says so)
when less time is left than it needs, and a watchdog (faulthandler) dumps every thread's stack and
ends the process when one runs far past its budget, so a hang prints where it hung. The results,
JSON and markdown, are written after every section (and before it, marked running, so a
watchdog's exit leaves the name of the section that hung) to each of the given paths, and again
after each of its rows. Every target
a section checks goes into one summary table with pass or fail; the exit status says whether all
sections ran and every target held.
"""

import faulthandler
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from flexh2o.common.output_files import write_json_atomic, write_text_atomic  # noqa: E402

WATCHDOG_GRACE_S = 120  # past its budget, a section gets this long before the watchdog ends the check


class Check:
    def __init__(self, outs: list[str], total_s: float, header: dict, describe):
        """outs: paths without extension (each gets .json and .md); describe(result) -> the
        markdown of the sections' own tables."""
        self.outs, self.describe = outs, describe
        self.deadline = time.monotonic() + total_s
        self.result = {**header, "budget_s": total_s, "sections": {}, "targets": []}

    def time_left(self) -> float:
        return self.deadline - time.monotonic()

    def target(self, section: str, name: str, value: str, goal: str, ok: bool):
        self.result["targets"].append({"section": section, "name": name, "value": value, "goal": goal,
                                       "ok": bool(ok)})

    def run(self, name: str, budget_s: float, fn):
        """fn(section) -> rows (a list of dicts) fills the section; section.over() says when its own
        budget is spent (a section with several runs stops starting new ones then)."""
        record = self.result["sections"][name] = {"status": "running", "budget_s": budget_s, "rows": []}
        left = self.time_left()
        if left < budget_s:
            record.update(status="skipped", why=f"{max(left, 0):.0f} s of the check's budget left, "
                                                f"the section needs {budget_s:.0f} s")
            print(f"[{name}] skipped: {record['why']}", flush=True)
            self.write()
            return
        self.write()
        print(f"[{name}] budget {budget_s:.0f} s", flush=True)
        faulthandler.dump_traceback_later(budget_s + WATCHDOG_GRACE_S, exit=True)
        section = Section(name, budget_s, record["rows"], self.write)
        start = time.monotonic()
        try:
            fn(section)
            record["status"] = "ok"
        except Exception as e:
            record.update(status="failed", error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())
            print(f"[{name}] failed: {type(e).__name__}: {e}", flush=True)
        finally:
            faulthandler.cancel_dump_traceback_later()
            record["seconds"] = time.monotonic() - start
            if section.skipped:
                record["skipped_rows"] = section.skipped
            for t in section.targets:
                self.target(name, *t)
            self.write()

    def passed(self) -> bool:
        return (all(s["status"] == "ok" for s in self.result["sections"].values())
                and all(t["ok"] for t in self.result["targets"]))

    def write(self):
        text = self.markdown()
        for out in self.outs:
            write_json_atomic(out + ".json", self.result)
            write_text_atomic(out + ".md", text)

    def markdown(self) -> str:
        r = self.result
        lines = [self.describe(r, header=True), "", "## Summary", "",
                 "| section | status | seconds (budget) |", "|---|---|---|"]
        for name, s in r["sections"].items():
            note = s.get("why") or s.get("error") or ""
            if s.get("skipped_rows"):
                note = f"over its budget, not run: {', '.join(s['skipped_rows'])}"
            status = s["status"] if s["status"] == "ok" else f"**{s['status']}**"
            lines.append(f"| {name} | {status}{': ' + note if note else ''} | "
                         f"{s.get('seconds', 0):.0f} ({s['budget_s']:.0f}) |")
        lines += ["", "| target | section | measured | goal | result |", "|---|---|---|---|---|"]
        lines += [f"| {t['name']} | {t['section']} | {t['value']} | {t['goal']} | "
                  f"{'pass' if t['ok'] else '**fail**'} |" for t in r["targets"]]
        lines += ["", self.describe(r, header=False)]
        return "\n".join(lines)


def machine_line(r: dict) -> str:
    """The header's sentence on where and how a check ran, from the result's header fields."""
    m = r.get("machine") or {}
    return (f"Machine: {m.get('cpu', '?')}, {m.get('logical_cores', '?')} cores, torch {r['torch']}, CUDA {r['cuda']}. "
            f"Command: `{r['command']}`, started {r['started']}.")


class Section:
    def __init__(self, name: str, budget_s: float, rows: list, write):
        self.name, self.rows, self.write = name, rows, write
        self.deadline = time.monotonic() + budget_s
        self.targets, self.skipped = [], []

    def over(self) -> bool:
        return time.monotonic() > self.deadline

    def add(self, row: dict):
        self.rows.append(row)
        print(f"[{self.name}] {row}", flush=True)
        self.write()

    def target(self, name: str, value: str, goal: str, ok: bool):
        self.targets.append((name, value, goal, ok))
