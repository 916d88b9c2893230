"""Prometheus metrics of a daemon, served on ``--metrics-port`` for a Prometheus server to scrape."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily


class _Collector:
    def __init__(self, daemon):
        self.daemon = daemon

    def collect(self):
        d = self.daemon
        with d.store.atomic():
            c = vars(d.store.counters).copy()
            used, limit = d.store.used_bytes, d.store.mem_limit
            latest = {j: d.store.latest_committed(j) for j in d.store.jobs()}
            progress = d.flusher.progress if d.flusher else None
            team = d.team.status() if d.team is not None else None
            fstate = d.flusher.state() if d.flusher else None
            from .status import degraded

            reasons = degraded(d, {"state": fstate[0], "current_step": progress.step, "seconds_without_progress": fstate[1],
                                   "last_error": progress.last_error} if fstate else None, team)
            damaged = d.damage.by_where(team)
        for name, value in c.items():
            yield CounterMetricFamily(f"ucpd_{name}", f"ucpd counter {name}", value=value)
        yield GaugeMetricFamily("ucpd_degraded", "1 while the daemon works with less than configured (see ucpd status)",
                                value=1 if reasons else 0)
        failures = CounterMetricFamily(
            "ucpd_checksum_failures", "bytes that failed their CRC32C, by where they were kept", labels=["where"]
        )
        for where in ("ram", "disk", "index", "replica", "parity", "peer", "transport"):
            failures.add_metric([where], damaged.get(where, 0))
        yield failures
        yield GaugeMetricFamily("ucpd_mem_used_bytes", "bytes held in shm slots", value=used)
        yield GaugeMetricFamily("ucpd_mem_limit_bytes", "memory limit for slots", value=limit)
        newest = GaugeMetricFamily("ucpd_latest_committed_step", "newest committed step of each job (-1: none)", labels=["job"])
        for job, v in sorted(latest.items()):
            newest.add_metric([job], v.step if v else -1)
        yield newest
        yield GaugeMetricFamily("ucpd_slots_warming", "spare slots of the ranks' rotations being prepared", value=d.prep.pending())
        yield CounterMetricFamily(
            "ucpd_warm_yielded_seconds", "seconds the slot warm-up stepped aside for snapshot copies", value=d.prep.yielded_s
        )
        if team is not None:
            yield from _team_metrics(team)
        if progress is not None:
            yield GaugeMetricFamily("ucpd_flush_bytes_done", "bytes written by the flush in progress", value=progress.bytes_done)
            yield GaugeMetricFamily("ucpd_flush_last_seconds", "duration of the last flush", value=progress.last_seconds)
            yield GaugeMetricFamily("ucpd_flush_stalled", "1 while the flush in progress writes nothing (hung flush dir)",
                                    value=1 if fstate[0] == "stalled" else 0)
            yield GaugeMetricFamily("ucpd_flush_seconds_without_progress", "seconds since the flush in progress wrote a byte",
                                    value=fstate[1])
            yield CounterMetricFamily("ucpd_flush_errors", "flushes that failed (full or failing flush dir)", value=progress.errors)
            yield CounterMetricFamily(
                "ucpd_flush_yielded_seconds", "seconds the flush stepped aside for snapshot copies", value=progress.yielded_s
            )


def _team_metrics(team: dict):
    live = GaugeMetricFamily("ucpd_team_node_live", "1 when a node of the team is alive", labels=["node"])
    for n in team["nodes"]:
        live.add_metric([str(n["node"])], 1 if n["live"] else 0)
    yield live
    held = GaugeMetricFamily("ucpd_team_bytes", "bytes this node holds, by redundancy level", labels=["level"])
    held.add_metric(["own"], team["bytes"]["own"])
    held.add_metric(["replicas"], team["bytes"]["replicas"])
    yield held
    yield GaugeMetricFamily("ucpd_team_healthy", "1 when every version is protected as configured", value=1 if team["health"] == "healthy" else 0)
    yield GaugeMetricFamily("ucpd_team_coordinator", "node rank of the commit coordinator", value=team["coordinator"] if team["coordinator"] is not None else -1)
    yield GaugeMetricFamily("ucpd_team_reprotect_pending", "copies being made again after a node loss", value=team["healing"]["pending"])
    lane = team.get("lane") or {}
    counters = {**team["counters"], **{f"peer_{k}": v for k, v in team["transport"].items()},
                **{f"lane_{k}": v for k, v in lane.get("counters", {}).items()}}
    for name, value in counters.items():
        yield CounterMetricFamily(f"ucpd_team_{name}", f"ucpd team counter {name}", value=value)
    link = GaugeMetricFamily("ucpd_team_link_gbps", "measured GB/s of the data lane to a peer (probe: at join; "
                             "observed: a moving average of real transfers)", labels=["node", "kind"])
    slow = GaugeMetricFamily("ucpd_team_link_slow", "1 when the link to a peer measured below --link-floor",
                             labels=["node"])
    for p in lane.get("peers", []):
        for kind in ("probe", "observed"):
            if p.get(f"{kind}_gbps") is not None:
                link.add_metric([str(p["node"]), kind], p[f"{kind}_gbps"])
        slow.add_metric([str(p["node"])], 1 if p.get("warning") else 0)
    yield link
    yield slow


class Metrics:
    def __init__(self, daemon, port: int, addr: str = "127.0.0.1"):
        self.registry = CollectorRegistry()
        self.registry.register(_Collector(daemon))
        self.server, self.thread = start_http_server(port, addr=addr, registry=self.registry)

    @property
    def port(self) -> int:
        return self.server.server_address[1]

    def close(self) -> None:
        self.server.shutdown()
