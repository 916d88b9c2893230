"""What a chaos campaign knows of its team's steps (which runs began each, the newest a rank saw
committed, when nodes were lost) and the checks of a trial against it: every step read back whole
and of one run, ``latest()`` never backwards, no refusal, every flushed version whole."""

from __future__ import annotations

import os
import re

from .job import CODE, JOB, flushed_codes
from .trial import category


class Ledger:
    """A team generation's record, and the checks that read it. ``fail(msg)`` (passed to each
    check) records a failure; ``note(msg)`` something the trial saw that is not one."""

    def __init__(self, per_node: int, tolerance: int, note) -> None:
        self.per_node, self.tolerance, self.note = per_node, tolerance, note
        self.forget()

    def forget(self) -> None:
        """A fresh team: what the last one held is gone."""
        self.reported: int | None = None  # newest step any rank saw committed (this team generation)
        self.snapshotted: dict[int, set[int]] = {}  # step -> runs that began it
        self.first_seen: dict[int, float] = {}  # step -> when a rank first began it (its commit is later)
        self.losses: list[float] = []  # when nodes were lost (their RAM deleted)
        self.bad_steps: dict[int, int] = {}  # step -> the trial that found it bad

    def absorb(self, run: int, j: dict[int, list[dict]]) -> None:
        """What a run's journals say: steps begun (by which run), steps seen committed."""
        for recs in j.values():
            for rec in recs:
                if rec["e"] == "begin":
                    self.snapshotted.setdefault(rec["step"], set()).add(run)
                    self.first_seen[rec["step"]] = min(self.first_seen.get(rec["step"], rec["t"]), rec["t"])
                elif rec["e"] == "committed":
                    self.reported = max(self.reported or 0, rec["step"])

    # --- checks ---------------------------------------------------------------------------------

    def where(self, rank: int) -> str:
        return f"rank {rank} on node {rank // self.per_node}"

    def ranks_text(self, ranks) -> str:
        """"ranks 2, 3 on node 1 and rank 4 on node 2"."""
        by_node: dict[int, list[int]] = {}
        for r in sorted(set(ranks)):
            by_node.setdefault(r // self.per_node, []).append(r)
        return " and ".join(f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))} on node {n}"
                            for n, rs in sorted(by_node.items()))

    def check_read(self, step: int, reads: dict[int, dict], fail, newest: bool = False, what: str = "committed step") -> None:
        """One step read back by every rank: whole, that step, one run everywhere."""
        runs_at: dict[int, set[int]] = {}  # run -> ranks that read it back as that run
        errors: dict[str, list[int]] = {}
        for rank, rec in sorted(reads.items()):
            if rec is None:
                errors.setdefault("no answer", []).append(rank)
                continue
            if "error" in rec:
                errors.setdefault(re.sub(r"\brank \d+", "rank N", rec["error"]), []).append(rank)
                continue
            if rec["got"] != step:
                fail(f"restore(step={step}) by {self.where(rank)} returned step {rec['got']}")
            dec = dict(rec["dec"])
            vals = dec.pop("values")
            if vals["step"] != step or vals["rank"] != rank:
                fail(f"{what} {step}: {self.where(rank)} read back plain values {vals}")
            mine: dict[int, list[str]] = {vals["run"]: ["plain values"]}
            for name, d in dec.items():
                if d["garbled"]:
                    fail(f"{what} {step}: {self.where(rank)}'s {name} has {d['garbled']} elements that decode "
                         f"to no run and step (damaged or misplaced bytes)")
                for code, count in d["codes"]:
                    run, s = divmod(code, CODE)
                    if code == 0:
                        fail(f"{what} {step}: {self.where(rank)}'s {name} has {count} zeros (not restored)")
                        continue
                    if s != step:
                        fail(f"{what} {step}: {self.where(rank)}'s {name} holds step {s} of run {run} ({count} elements)")
                    mine.setdefault(run, []).append(name)
            if len(mine) > 1:
                fail(f"{what} {step}: {self.where(rank)} mixes runs: "
                     + ", ".join(f"run {r} in {', '.join(n)}" for r, n in sorted(mine.items())))
            for run in mine:
                runs_at.setdefault(run, set()).add(rank)
        if errors:
            kinds = {category(e) for e in errors}
            # losses since the step was first begun (an upper bound on those since it committed)
            lost = sum(1 for t in self.losses if t > self.first_seen.get(step, 0.0))
            if newest or kinds - {"VersionNotFound"} or lost <= self.tolerance:
                fail(f"{what} {step}{' (the newest, latest())' if newest else ''} could not be read back"
                     f"{f' after {lost} node loss(es) (redundancy {self.tolerance})' if not newest else ''}: "
                     + "; ".join(f"{self.ranks_text(rs)}: {e}" for e, rs in errors.items()))
            else:
                self.note(f"{what} {step} is lost: " + "; ".join(f"{self.ranks_text(rs)}: {e}" for e, rs in errors.items()))
        if len(runs_at) > 1 and len(set().union(*runs_at.values())) > 1:  # one rank alone: "mixes runs" said it
            fail(f"{what} {step} read back " + ", but ".join(
                f"as run {run} by {self.ranks_text(rs)}" for run, rs in sorted(runs_at.items())))
        for run in runs_at:
            if run not in self.snapshotted.get(step, {run}):
                fail(f"{what} {step} read back as run {run}, a run that never snapshotted it "
                     f"(runs that did: {sorted(self.snapshotted.get(step, ()))})")

    def check_flush_dir(self, flush_dir: str | None, fail, newest: int | None) -> None:
        """With ``--flush-dir`` (every node writes its share): no torn version, every complete one
        whole (each chunk of each file against its ``ucp.json``), none newer than the newest
        committed step."""
        if flush_dir is None:
            return
        from ucpd.format import list_versions, validate

        root = os.path.join(flush_dir, JOB)
        if not os.path.isdir(root):
            return
        versions = list_versions(root)
        torn = [v.step for v in versions if v.state == "torn"]
        if torn:
            fail(f"torn versions in the flush dir: {torn}")
        for v in versions:
            if v.state == "complete":
                problems = validate(root, v.step, full=True)
                if problems:
                    fail(f"flushed step {v.step} does not validate: {problems[:2]}")
                if newest is not None and v.step > newest:
                    fail(f"flushed step {v.step} is newer than the newest committed {newest}")
                codes = flushed_codes(root, v.step)
                if len(codes) != 1 or next(iter(codes)) % CODE != v.step:
                    fail(f"flushed step {v.step} holds the values of runs/steps {sorted(codes)}: stitched or misplaced")

    def check_run(self, run: int, j: dict[int, list[dict]], fail, clean: bool, injected_at: float | None,
                  reported: int | None) -> None:
        """A run's journals: refusals are failures; a clean run (no fault during it) commits every step;
        ``reported``: the newest step a rank saw committed before this run began."""
        starts = {}
        errors: dict[tuple, list[int]] = {}
        unfinished = []
        restored: dict[int, dict] = {}  # step -> {rank: its restore at the start of the run}
        for rank, recs in sorted(j.items()):
            for rec in recs:
                if rec["e"] == "latest":
                    starts[rank] = rec["step"]
                    if reported is not None and (rec["step"] is None or rec["step"] < reported) and (
                            injected_at is None or rec["t"] < injected_at):
                        fail(f"run {run}: {self.where(rank)} read latest() {rec['step']} at start, "
                             f"but a rank saw step {reported} committed")
                elif rec["e"] == "restored":
                    restored.setdefault(rec["step"], {})[rank] = {**rec, "got": rec["step"]}
                elif rec["e"] == "error":
                    before = injected_at is None or rec["t"] < injected_at
                    msg = re.sub(r"\brank \d+", "rank N", rec["msg"])
                    errors.setdefault((rec["step"], rec["type"], msg, before), []).append(rank)
            if clean and (not recs or recs[-1]["e"] != "done") and not any(r["e"] == "error" for r in recs):
                unfinished.append(rank)
        for (step, typ, msg, before), rs in sorted(errors.items(), key=lambda kv: (kv[0][0] or 0, kv[0][1])):
            text = f"run {run}: {self.ranks_text(rs)} at step {step}: {typ}: {msg}"
            if typ in ("SnapshotRejected", "ProtocolError", "ChecksumMismatch", "PlacementMismatch") or before:
                fail(text)
            else:
                self.note(text)
        for step, reads in sorted(restored.items()):
            self.check_read(step, reads, fail, newest=True, what=f"run {run}'s restore of the newest committed step,")
        if unfinished:  # torn down after another rank failed: that failure is the one to tell
            (self.note if errors else fail)(f"run {run}: {self.ranks_text(unfinished)} did not commit every step")
        if len(set(starts.values())) > 1:
            fail(f"run {run}: ranks disagree on latest() at start: {starts}")
