"""What ``ucpd status`` shows: the daemon's state collected as a JSON-able map, and its table."""

from __future__ import annotations

import os
import time


class ChecksumFailures:
    """Checksum failures detected by this daemon or reported by its clients, by where the
    damaged bytes were ("ram": a slot, "disk": a flushed file, "index": the shm index); a team's
    (replica, parity, peer, transport) are added from its status."""

    def __init__(self, index: int = 0) -> None:
        self._counts: dict[str, int] = {"index": index} if index else {}

    def note(self, where: str, n: int = 1) -> None:
        """Count ``n`` checksum failures of bytes kept in ``where``."""
        self._counts[where] = self._counts.get(where, 0) + n

    def by_where(self, team: dict | None = None) -> dict[str, int]:
        """This daemon's counts, and its team's as the team's ``status()`` (``team``) gives them."""
        out = dict(self._counts)
        if team is not None:
            counters = team["counters"]
            more = {
                "replica": counters.get("replica_checksum_errors", 0),
                "parity": counters.get("parity_checksum_errors", 0),
                "peer": counters.get("fetch_checksum_errors", 0),
                "transport": team["transport"].get("checksum_errors", 0),
            }
            for k, v in more.items():
                if v:
                    out[k] = out.get(k, 0) + v
        return out


def collect(daemon) -> dict:
    """Snapshot of the daemon's state (caller makes it one: ``with store.atomic()``)."""
    store = daemon.store
    cfg = daemon.config
    versions = []
    for v in sorted(store.versions(), key=lambda v: (v.job, v.step)):
        versions.append(
            {
                "job": v.job,
                "step": v.step,
                "state": v.state.value,
                "ranks": sorted(v.parts),
                "world_size": v.world_size,
                "bytes": v.nbytes,
                # of those, bytes of unchanged tensors read from an older version's slot (incremental)
                "shared_bytes": sum(t.nbytes for p in v.parts.values() for t in p.tensors if t.holder is not None),
                "tensors": sum(len(p.tensors) for p in v.parts.values()),
                "on_disk": v.on_disk,
                "readers": v.pins,  # restores and flushes (this node's or a peer's) reading it now: kept past --keep
                "age_s": round(time.time() - v.created, 1),
            }
        )
    slots = store.slot_counts()
    slots["warming"] = daemon.prep.pending()  # spares of the ranks' rotations being prepared
    warm_yielded_s = round(daemon.prep.yielded_s, 3)
    flush = None
    if daemon.flusher is not None:
        p = daemon.flusher.progress
        flush = {
            "dir": cfg.flush_dir,
            "every": cfg.flush_every if cfg.flush_every is not None else "auto",
            "interval": {j: daemon.flusher.interval.explain(j) for j in store.jobs()},
            "current_step": p.step,
            "bytes_done": p.bytes_done,
            "bytes_total": p.bytes_total,
            "last_flushed": p.last_flushed,
            "last_seconds": round(p.last_seconds, 3),
            "flushed_count": p.flushed_count,
            "last_error": p.last_error,
            "state": (fstate := daemon.flusher.state())[0],
            "seconds_without_progress": round(fstate[1], 1),
            "errors": p.errors,
            "yielded_s": round(p.yielded_s, 3),  # stepped aside for snapshot copies
        }
    jobs = []
    for name in store.jobs():
        newest = store.latest_committed(name)
        jobs.append(
            {
                "job": name,
                "versions": sum(1 for v in store.versions() if v.job == name and v.parts),
                "latest_committed": newest.step if newest else None,
                "bytes": store.job_bytes(name),
                "quota": store.job_limit or None,
                "flush_dir": daemon.locate.job_flush_dir(name),
            }
        )
    # the newest committed step of the team's job, or of the one job here (None with several)
    names = store.jobs()
    only = store.team_job or (names[0] if len(names) == 1 else None)
    latest = store.latest_committed(only) if only is not None else None
    team = daemon.team.status() if daemon.team is not None else None
    return {
        "pid": os.getpid(),
        "uptime_s": round(time.time() - daemon.started, 1),
        "node_rank": cfg.node_rank,
        "nodes": cfg.nodes,
        "run_dir": cfg.run_dir,
        "shm_dir": cfg.shm_dir,
        "mem_limit": store.mem_limit,
        "mem_used": store.used_bytes,
        "keep": store.keep,
        "latest_committed": latest.step if latest else None,
        "checksum_failures": daemon.damage.by_where(team),
        "jobs": jobs,
        "team_job": store.team_job,
        "job_mem_limit": store.job_limit or None,
        "versions": versions,
        "slots": slots,
        "warm_yielded_s": warm_yielded_s,
        "clients": daemon.clients,
        # where Prometheus scrapes /metrics (the bound port, also when --metrics-port 0 chose one)
        "metrics_port": daemon.metrics.port if daemon.metrics is not None else None,
        "flush": flush,
        "redundancy": {"level": "L0 (this node's RAM)", "healthy": True}
        if daemon.team is None
        else {"level": team["level"], "healthy": team["health"] == "healthy"},
        "team": team,
        "degraded": degraded(daemon, flush, team),
        "counters": vars(store.counters).copy(),
        # the last restores: where each one's time went before its reply (admit, holdings, plan, fetch...)
        "restore": daemon.restores.recent.to_status(),
    }


def degraded(daemon, flush: dict | None, team: dict | None) -> list[str]:
    """What works less well than configured, one line each ([]: nothing): a flush that is
    stalled or failing (snapshots go on in RAM), a flush dir that does not answer, dead peers
    and committed versions that survive fewer losses than ``--replicas`` / ``--parity`` give."""
    out = []
    if flush is not None and flush["state"] == "stalled":
        out.append(f"flush stalled: step {flush['current_step']} has written nothing for "
                   f"{flush['seconds_without_progress']:.0f} s (flush dir hung or very slow; snapshots go on in RAM)")
    if flush is not None and flush["state"] == "failing":
        out.append(f"flush failing: {flush['last_error']} (snapshots go on in RAM)")
    slow = daemon.locate.disk_unresponsive
    if slow:
        out.append(f"flush dir unresponsive: a lookup in {daemon.config.flush_dir} did not return ({slow}); "
                   "latest/restore answer from RAM")
    if team is not None:
        dead = [n["node"] for n in team["nodes"] if not n["live"]]
        if dead:
            out.append(f"team: nodes {dead} not answering (dead or stuck)")
        out.extend(f"team: {p['warning']}" for p in team.get("lane", {}).get("peers", []) if p.get("warning"))
        few = [v["step"] for v in team["versions"] if v["health"] == "degraded"]
        if few:
            out.append(f"team: committed steps {few} survive fewer node losses than configured (--replicas / --parity)")
    return out


def _size(n: int | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def memory_row(status: dict) -> str:
    """``12.0 MiB of 1.0 GiB in 3 slots (2 held by versions, 1 free), 1 spare warming``."""
    slots = status.get("slots") or {}
    states = {"held": "held by versions", "writing": "being written", "free": "free"}
    parts = [f"{slots[k]} {label}" for k, label in states.items() if slots.get(k)]
    total = sum(slots.get(k, 0) for k in states)
    text = f"{_size(status['mem_used'])} of {_size(status['mem_limit'])} in {total} slot{'s' if total != 1 else ''}"
    if parts:
        text += f" ({', '.join(parts)})"
    if slots.get("warming"):
        text += f", {slots['warming']} spare{'s' if slots['warming'] != 1 else ''} warming"
    return text


def render(status: dict, console) -> None:
    """Print the status map as readable tables on a rich console."""
    from rich.table import Table

    head = Table(show_header=False, box=None, pad_edge=False)
    head.add_row("daemon", f"pid {status['pid']}, node {status['node_rank']} of {status['nodes']}, up {status['uptime_s']:.0f} s")
    head.add_row("run dir", status["run_dir"])
    head.add_row("shm dir", status["shm_dir"])
    head.add_row("memory", memory_row(status))
    if len(status.get("jobs", ())) <= 1:
        head.add_row("latest committed", str(status["latest_committed"]))
    head.add_row("redundancy", f"{status['redundancy']['level']}, {'healthy' if status['redundancy']['healthy'] else 'DEGRADED'}")
    for line in status.get("degraded") or ():
        head.add_row("DEGRADED", line)
    if status.get("metrics_port") is not None:
        head.add_row("metrics", f"http://127.0.0.1:{status['metrics_port']}/metrics")
    c = status["counters"]
    head.add_row("counters", ", ".join(f"{k}={v}" for k, v in c.items()))
    console.print(head)
    if status.get("jobs"):
        jobs = Table(title="jobs" + (f" (this team serves {status['team_job']!r})" if status.get("team_job") else ""))
        for col in ("job", "versions", "latest committed", "bytes", "quota", "flushed to"):
            jobs.add_column(col, justify="right" if col in ("versions", "latest committed", "bytes", "quota") else "left")
        for j in status["jobs"]:
            jobs.add_row(
                j["job"], str(j["versions"]), str(j["latest_committed"]), _size(j["bytes"]), _size(j["quota"]),
                j["flush_dir"] or "-",
            )
        console.print(jobs)
    table = Table(title="versions")
    for col in ("job", "step", "state", "ranks", "tensors", "bytes", "on disk", "age"):
        table.add_column(col, justify="right" if col in ("step", "tensors", "bytes", "age") else "left")
    for v in status["versions"]:
        table.add_row(
            v.get("job", "-"), str(v["step"]), v["state"], f"{len(v['ranks'])}/{v['world_size']}", str(v["tensors"]), _size(v["bytes"]),
            "yes" if v["on_disk"] else "no", f"{v['age_s']:.0f} s",
        )
    console.print(table)
    team = status.get("team")
    if team:
        _render_team(team, console)
    f = status.get("flush")
    if f:
        if f["current_step"] is not None:
            pct = 100.0 * f["bytes_done"] / max(1, f["bytes_total"])
            now = f"flushing step {f['current_step']}: {pct:.0f}% of {_size(f['bytes_total'])}"
        else:
            now = "idle"
        console.print(
            f"flush to {f['dir']} every {f['every']} version(s): {now}; last flushed step {f['last_flushed']} "
            f"in {f['last_seconds']} s; {f['flushed_count']} flushed; stepped aside for snapshots {f['yielded_s']} s"
            + (f"; last error: {f['last_error']}" if f["last_error"] else "")
        )
        for job, why in (f.get("interval") or {}).items():
            if why.get("mode") == "auto":
                console.print(
                    f"  {job}: flush every {why['every']} version(s) (auto): interval {why['interval_s']} s from a flush "
                    f"of {why['flush_cost_s']} s, a commit every {why['commit_period_s']} s and an MTBF of "
                    f"{why['mtbf_s'] / 3600:.1f} h ({why['mtbf_from']})"
                )


def _render_team(team: dict, console) -> None:
    from rich.table import Table

    nodes = Table(title=f"team: {team['level']}, {team['health']}, coordinator node {team['coordinator']}, "
                        f"latest committed {team['team_latest']}")
    for col in ("node", "address", "domain", "state", "data lane (path)", "link GB/s (probe / seen)"):
        nodes.add_column(col)
    lane = team.get("lane") or {}
    links = {p["node"]: p for p in lane.get("peers", [])}
    for n in team["nodes"]:
        state = ("live" if n["live"] else "DEAD") + (" (coordinator)" if n["coordinator"] else "")
        link = links.get(n["node"], {})
        if n["node"] == team["node_rank"]:
            path, speed = f"{lane.get('transport', '-')} on {lane.get('address') or '-'}", ""
        else:
            path = link.get("path") or ("-" if lane.get("transport") != "zmq" else "control lane (zmq)")
            speed = " / ".join("-" if link.get(k) is None else f"{link[k]:.2f}" for k in ("probe_gbps", "observed_gbps"))
            if link.get("warning"):
                speed += " SLOW"
        nodes.add_row(str(n["node"]) + (" *" if n["node"] == team["node_rank"] else ""), str(n["address"]),
                      str(n["domain"] or "-"), state, path, speed)
    console.print(nodes)
    b = team["bytes"]
    h = team["healing"]
    console.print(
        f"bytes held: own {_size(b['own'])}, replicas of others {_size(b['replicas'])}"
        + (f" (overhead {team['overhead']}x)" if team["overhead"] else "")
        + f"; re-protection: {h['pending']} pending, {h['done']} done, {h['failed']} failed"
    )
    if team["versions"]:
        v = Table(title="redundancy of this node's versions")
        for col in ("step", "copies on", "health"):
            v.add_column(col)
        for row in team["versions"]:
            v.add_row(str(row["step"]), ", ".join(map(str, row["holders"])) or "-", row["health"])
        console.print(v)
