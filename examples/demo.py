"""The main job: a GPT trained with tensor x pipeline parallelism loses a node mid-run and
resumes, from the surviving node's RAM, on another parallel layout.

    make demo        (or: .venv/bin/python examples/demo.py [--steps 100] [--fail-at 40] [--nodes 1])

1. Two node daemons on loopback form a team with one replica: each node's part of every
   version is copied to the other node's RAM before the version commits.
2. A reference run trains the same GPT without interruption (one process, TP1 x PP1 x DP1).
3. The job trains with 4 ranks, TP2 x PP2 (2 ranks per node: node 0 holds pipeline stage 0,
   node 1 stage 1), snapshotting every step. After step --fail-at is committed the trainers
   wait for the go-ahead; instead node 1 is lost: its daemon and trainers are SIGKILLed and its
   shared memory wiped. The job is torn down.
4. The job restarts on the surviving node with 2 ranks, TP1 x PP1 x DP2: every rank restores
   the last committed step from node 0's RAM (its own part plus the replica of node 1's),
   resharded to its layout — weights, ZeRO-1 Adam moments, schedule, data-loader position —
   and trains to the end, still snapshotting.
5. Prints the time lost, the restore time and the loss curve beside the reference run, as a
   table and as a PNG.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time

from rich.markup import escape

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

TOLERANCE = 1e-5  # relative: what summation order may change (~1e-7 seen); a wrong slice changes 1e-3 or more


class Interrupted(Exception):
    pass


def _on_signal(signum, _frame):
    raise Interrupted(f"interrupted by {signal.Signals(signum).name}")


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=100, help="training steps (default 100)")
    ap.add_argument("--fail-at", type=int, default=None, help="lose the node after this step is committed (default 40%% of --steps)")
    ap.add_argument("--nodes", type=int, choices=(1, 2), default=2,
                    help="2: a team of two daemons, node 1 is lost (default); 1: one daemon, every trainer is killed")
    ap.add_argument("--out", default="demo_out", help="folder for loss.png and the logs (default ./demo_out)")
    args = ap.parse_args(argv)
    if args.steps < 3:
        ap.error("--steps must be at least 3")
    if args.fail_at is None:
        args.fail_at = max(1, round(args.steps * 0.4))
    if not 1 <= args.fail_at < args.steps:
        ap.error(f"--fail-at must be in [1, {args.steps - 1}] so that the loss lands mid-run")
    return args


def main(argv=None) -> int:
    args = parse(argv)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _on_signal)
    from rich.console import Console

    console = Console(highlight=False)
    demo = Demo(args, console)
    try:
        ok = demo.run()
    except (KeyboardInterrupt, Interrupted) as exc:
        console.print(f"[red]demo stopped[/]: {escape(str(exc) or 'interrupted')}; cleaning up")
        ok = False
    except Exception as exc:  # no traceback: say what failed
        console.print(f"[red]demo FAILED[/] while {escape(demo.stage)}: {escape(type(exc).__name__)}: {escape(str(exc))}")
        try:
            demo.point_to_logs()
        except Exception:
            pass
        ok = False
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)  # clean up without a second interruption
        demo.cleanup()
    return 0 if ok else 1


class Demo:
    def __init__(self, args, console):
        self.args, self.console = args, console
        self.stage = "starting"
        self.work = tempfile.mkdtemp(prefix="ucpd-demo-")
        self.out = os.path.abspath(args.out)
        self.logs = os.path.join(self.out, "logs")
        self.cluster = None
        self.jobs: list = []

    # --- plumbing ----------------------------------------------------------------------------

    def cleanup(self) -> None:
        for job in self.jobs:
            try:
                job.close()
            except Exception:
                pass
        if self.cluster is not None:
            for node in self.cluster.nodes:
                try:
                    node.stop()
                except Exception:
                    pass
                try:
                    os.makedirs(self.logs, exist_ok=True)
                    shutil.copy(node.log, os.path.join(self.logs, f"daemon-node{node.index}.log"))
                except OSError:
                    pass
        shutil.rmtree(self.work, ignore_errors=True)

    def point_to_logs(self) -> None:
        if self.cluster is not None:
            for node in self.cluster.nodes:
                if node.alive or node.index == 0:
                    self.console.print(f"  node {node.index} daemon, last log line: {escape(node.last_log_line())}")
        self.console.print(f"  logs: {escape(self.logs)}/ (the trainers' and the daemons')")

    def say(self, text: str) -> None:
        self.console.print(text)

    def progress(self, title: str, total: int, done: int = 0):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        p = Progress(
            TextColumn("  {task.description}"), BarColumn(bar_width=30), MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}"), TimeElapsedColumn(),
            console=self.console, transient=False,
        )
        task = p.add_task(title, total=total, completed=done, loss="  -   ")
        return p, task

    def train(self, spec, name: str, title: str, *, until: str = "done", on_message=None):
        """Run (or, with until='parked', start) a job with a progress bar; returns (job, reports)."""
        from gpt import Job

        job = Job(spec, name)
        self.jobs.append(job)  # stopped by cleanup() whatever happens
        job.start()
        bar, task = self.progress(title, spec.train.steps, 0)
        got = []
        with bar:
            def follow(msg):
                got.append(msg)
                if msg[0] == "step":
                    bar.update(task, completed=msg[2]["step"], loss=f"{msg[2]['loss']:.4f}")
                elif msg[0] == "restored":
                    bar.update(task, completed=msg[2]["step"])
                return on_message(msg) if on_message else None

            job.run(follow, until=until, timeout=180)
        return job, got

    # --- the scene ---------------------------------------------------------------------------

    def run(self) -> bool:
        from gpt import RunSpec, TrainConfig, losses
        from gpt.daemons import Cluster

        a, say = self.args, self.say
        shutil.rmtree(self.logs, ignore_errors=True)  # this run's logs only
        os.makedirs(self.logs, exist_ok=True)
        team = a.nodes == 2
        tc = TrainConfig(steps=a.steps)
        base = RunSpec(train=tc)
        p1 = base.with_(tp=2, pp=2, dp=1)
        p2 = base.with_(tp=1, pp=1, dp=2)
        model = p1.model
        say(f"[bold]ucpd demo[/]: a GPT ({model.layers} layers, hidden {model.hidden}, {model.heads} query / "
            f"{model.kv_heads} key-value heads, vocabulary {model.vocab_size}) trained for {a.steps} steps; "
            f"{'node 1' if team else 'every trainer'} is lost after step {a.fail_at}")

        self.stage = "starting the daemons"
        self.cluster = Cluster(self.work, a.nodes, replicas=1, keep=2)
        self.cluster.start()  # (a daemon that fails to start is reported; those started are stopped)
        if team:
            say(f"[1] two node daemons on loopback, a team with --replicas 1 "
                f"(run dirs and /dev/shm segments private to this demo)")
        else:
            say("[1] one node daemon (run dir and /dev/shm segments private to this demo)")

        self.stage = "running the reference"
        say("[2] reference: the same job without a failure, TP1 x PP1 x DP1 (one process)")
        _, ref_msgs = self.train(base.with_(log_dir=os.path.join(self.logs, "reference")), "reference", "reference")
        ref = losses(ref_msgs)

        self.stage = "training with TP2 x PP2"
        per_node = 2 if team else 4
        say(f"[3] the job: 4 ranks, TP2 x PP2 x DP1, {'2 ranks on each node (node 1: pipeline stage 1)' if team else 'on one node'}, "
            f"a snapshot every step")
        spec1 = p1.with_(run_dirs=self.cluster.run_dirs, ranks_per_node=per_node, job_id=f"demo-{os.getpid()}-1",
                         hold_at=a.fail_at, log_dir=os.path.join(self.logs, "phase1"))
        job1, msgs1 = self.train(spec1, "TP2xPP2 job", "TP2xPP2xDP1", until="parked")
        run1 = losses(msgs1)
        calls = [m[2]["snapshot_call"] for m in msgs1 if m[0] == "step" and m[2]["snapshot_call"] is not None]
        steps1 = [m[2]["seconds"] for m in msgs1 if m[0] == "step"]
        if team:
            s = self.cluster.nodes[0].status()
            held = (s.get("team") or {}).get("bytes", {}).get("replicas")
            extra = f"; node 0 holds {held / 1024:.0f} KiB of replicas of node 1's parts" if held else ""
            say(f"    step {a.fail_at} committed on both nodes{extra}; the trainers wait for the go-ahead")

        self.stage = f"losing {'node 1' if team else 'the trainers'}"
        t_loss = time.monotonic()
        if team:
            job1.kill([2, 3])  # node 1's trainers ...
            self.cluster.nodes[1].lose()  # ... its daemon and its RAM
            job1.kill([0, 1])  # the job is torn down; node 0's daemon keeps the state
            say(f"    [bold red]** node 1 lost after step {a.fail_at}: daemon and trainers SIGKILLed, "
                f"shm wiped; the job is down **[/]")
            self.cluster.wait_dead(1, on=0)
            t_detect = time.monotonic() - t_loss
            say(f"    node 0 declared node 1 dead after {t_detect:.1f} s")
        else:
            job1.kill()
            t_detect = 0.0
            say(f"    [bold red]** every trainer SIGKILLed after step {a.fail_at}: the job is down **[/]")
        job1.close()

        self.stage = "resuming with TP1 x DP2"
        say(f"[4] the job restarts on node 0 with 2 ranks, TP1 x PP1 x DP2, and restores step {a.fail_at} from RAM")
        spec2 = p2.with_(run_dirs=self.cluster.run_dirs[:1], ranks_per_node=2, job_id=f"demo-{os.getpid()}-2",
                         resume=True, log_dir=os.path.join(self.logs, "phase2"))
        marks: dict[str, float] = {}

        def timing(msg):
            marks.setdefault(msg[0], time.monotonic())  # first of each kind of report
            return None

        t_restart = time.monotonic()
        _, msgs2 = self.train(spec2, "TP1xDP2 job", "TP1xPP1xDP2", on_message=timing)
        restored = [m[2] for m in msgs2 if m[0] == "restored"]
        if not restored or any(r["step"] != a.fail_at for r in restored):
            raise RuntimeError(f"the restarted job restored step {[r['step'] for r in restored]}, expected {a.fail_at}")
        restore_s = max(r["seconds"] for r in restored)
        run2 = losses(msgs2)
        lost_s = marks.get("ready", time.monotonic()) - t_loss

        self.stage = "comparing with the reference"
        _, worst = self.table(ref, run1, run2, a.fail_at)
        self.say("")
        self.say(f"  snapshot() returned in {statistics.median(calls) * 1e3:.2f} ms (median over {len(calls)} steps; "
                 f"a TP2xPP2 step took {statistics.median(steps1) * 1e3:.0f} ms)" if calls else "")
        self.say(f"  steps lost: 0 (step {a.fail_at} was committed before the loss)")
        start_s = marks.get("restored", t_restart) - t_restart - restore_s
        parts = [f"failure detection {t_detect:.1f} s"] if team else []
        parts += [f"new job's processes, gloo and model {max(0.0, start_s):.1f} s", f"restore {restore_s:.1f} s"]
        self.say(f"  time lost: [bold]{lost_s:.1f} s[/] from the loss until training resumed at step {a.fail_at + 1} "
                 f"({', '.join(parts)})")
        self.say(f"  restore from RAM, resharded TP2xPP2xDP1 -> TP1xPP1xDP2: [bold]{restore_s * 1e3:.0f} ms[/] "
                 f"(slowest rank; weights, ZeRO-1 Adam moments, schedule, data-loader position)")
        if team:
            s = self.cluster.nodes[0].status()
            health = (s.get("team") or {}).get("health", "?")
            self.say(f"  the resumed job's snapshots kept committing on node 0 alone: latest committed step "
                     f"{s.get('latest_committed')}, team {health}")
        png = self.plot(ref, run1, run2, a.fail_at)
        ok = worst <= TOLERANCE
        if ok:
            self.say(f"[bold green]demo OK[/]: the resumed run follows the reference (largest relative loss difference "
                     f"{worst:.1e}, tolerance {TOLERANCE:.0e}: summation order differs between TP2 and TP1)")
        else:
            self.say(f"[bold red]demo FAILED[/]: the resumed run departs from the reference (relative difference "
                     f"{worst:.1e} > {TOLERANCE:.0e})")
        if png:
            self.say(f"  loss curve: {png}")
        return ok

    def table(self, ref, run1, run2, fail_at):
        from rich.table import Table

        steps = sorted(ref)
        show = set(steps[:: max(1, len(steps) // 12)]) | {fail_at - 1, fail_at, fail_at + 1, fail_at + 2, steps[-1]}
        t = Table(title="loss: uninterrupted reference vs the run that lost a node", title_justify="left")
        for col in ("step", "layout", "reference", "interrupted run", "|difference|"):
            t.add_column(col, justify="right")
        worst = 0.0
        for s in steps:
            got = run1.get(s) if s <= fail_at else run2.get(s)
            if got is None:
                raise RuntimeError(f"no loss was reported for step {s}")
            diff = abs(got - ref[s])
            worst = max(worst, diff / max(abs(ref[s]), 1e-12))
            if s in show:
                layout = "TP2xPP2xDP1" if s <= fail_at else "TP1xPP1xDP2"
                t.add_row(str(s), layout, f"{ref[s]:.6f}", f"{got:.6f}", f"{diff:.1e}",
                          style="bold" if s in (fail_at, fail_at + 1) else None)
            if s == fail_at:
                lost = "node 1 lost" if self.args.nodes == 2 else "job killed"
                t.add_row("", f"[red]{lost}[/]", "", "[red]restore[/]", "")
        self.console.print(t)
        return t, worst

    def plot(self, ref, run1, run2, fail_at) -> str | None:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            self.say("  (no PNG: matplotlib is not installed — `pip install matplotlib`)")
            return None
        steps = sorted(ref)
        fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
        top.plot(steps, [ref[s] for s in steps], color="0.6", lw=4, label="reference (uninterrupted, TP1xPP1xDP1)")
        s1 = [s for s in steps if s <= fail_at]
        s2 = [s for s in steps if s > fail_at]
        where = "2 nodes" if self.args.nodes == 2 else "1 node"
        top.plot(s1, [run1[s] for s in s1], color="tab:blue", lw=1.5, label=f"job, TP2xPP2xDP1 ({where})")
        top.plot(s2, [run2[s] for s in s2], color="tab:orange", lw=1.5, label="resumed from RAM, TP1xPP1xDP2 (node 0)")
        for ax in (top, bottom):
            ax.axvline(fail_at + 0.5, color="tab:red", ls="--", lw=1)
        lost = "node 1 lost" if self.args.nodes == 2 else "trainers killed"
        top.text(fail_at + 1, max(ref.values()) * 0.97, lost, color="tab:red")
        top.set_ylabel("training loss")
        top.legend()
        top.set_title("ucpd: a GPT job loses a node and resumes from RAM on another layout")
        diffs = {s: abs((run1 if s <= fail_at else run2)[s] - ref[s]) for s in steps}
        nonzero = [s for s in steps if diffs[s] > 0]
        floor = min([diffs[s] for s in nonzero] + [1e-7]) / 10
        bottom.semilogy(nonzero, [diffs[s] for s in nonzero], "o", color="tab:purple", ms=3, label="|difference|")
        same = [s for s in steps if diffs[s] == 0]
        bottom.semilogy(same, [floor] * len(same), "x", color="tab:green", ms=4, label="bit-identical")
        bottom.set_ylim(floor / 3, max([floor * 100] + [diffs[s] * 10 for s in nonzero]))
        bottom.legend(loc="upper left", fontsize="small", ncol=2)
        bottom.set_ylabel("|loss difference|")
        bottom.set_xlabel("step")
        fig.tight_layout()
        os.makedirs(self.out, exist_ok=True)
        path = os.path.join(self.out, "loss.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return path


if __name__ == "__main__":
    sys.exit(main())
