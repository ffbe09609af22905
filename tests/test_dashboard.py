"""The Grafana dashboard and the Prometheus config in deploy/, against the real services.

The dashboard is JSON nobody runs in CI, so two things are checked here: its shape
(panels with targets with PromQL, on the provisioned data source, laid out on Grafana's
24-column grid), and that every metric its queries name is one the live API, scheduler
and worker really expose, so a renamed metric fails this test instead of leaving an
empty panel.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import yaml
from kafka import KafkaProducer
from prometheus_client.parser import text_string_to_metric_families

from kvfleet.settings import Settings
from tests.fleet import free_port

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
DASHBOARD = json.loads((DEPLOY / "grafana" / "dashboards" / "kvfleet.json").read_text())
PANEL_TYPES = {"timeseries", "stat", "gauge", "bargauge", "table", "heatmap"}
#: Series Prometheus makes itself for every target it scrapes (the worker health panel
#: uses `up`); no service exposes them.
SCRAPE_SERIES = {"up", "scrape_duration_seconds", "scrape_samples_scraped"}
# PromQL words that look like identifiers but name no metric.
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
             "offset", "inf", "nan"}
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'')
_MATCHERS = re.compile(r"\{[^}]*\}")
_RANGE = re.compile(r"\[[^\]]*\]")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
# A whole identifier (not the tail of a number like 1e-9, nor a $grafana_variable) that
# is not called: a function name is always followed by '('.
_IDENT = re.compile(r"(?<![\w.$:])([A-Za-z_:][\w:]*)\b(?!\s*\()")


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects."""
    text = _STRING.sub('""', expr)  # label values first: they may hold any character
    text = _MATCHERS.sub(" ", text)  # label names and values
    text = _RANGE.sub(" ", text)  # [5m], [$__rate_interval]
    text = _GROUPING.sub(" ", text)  # by (le, priority): label names
    return {m for m in _IDENT.findall(text) if m.lower() not in _KEYWORDS}


def panels() -> list[dict]:
    """Every panel but rows (a row's own `panels` hold collapsed ones)."""
    out = []
    for panel in DASHBOARD["panels"]:
        out += panel.get("panels", []) if panel["type"] == "row" else [panel]
    return out


def exprs() -> list[str]:
    return [t["expr"] for p in panels() for t in p["targets"]]


def test_metric_names_are_parsed_out_of_promql():
    assert metric_names('histogram_quantile(0.95, sum by (le, priority) (rate(a_bucket{x="y}"}[$__rate_interval])))') \
        == {"a_bucket"}
    assert metric_names("max(b_tokens) / clamp_min(max(c_tokens), 1e-9)") == {"b_tokens", "c_tokens"}
    assert metric_names('sum(up{job="kvfleet-worker"}) or on (instance) d_total offset 5m') == {"up", "d_total"}
    assert metric_names("count without (instance) (e)") == {"e"}


def test_dashboard_has_the_expected_structure():
    assert DASHBOARD["uid"] and DASHBOARD["title"] and isinstance(DASHBOARD["schemaVersion"], int)
    source = yaml.safe_load((DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yml").read_text())
    uid = source["datasources"][0]["uid"]
    ids = [p["id"] for p in DASHBOARD["panels"]] + [p["id"] for p in panels() if p not in DASHBOARD["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in panels():
        title = panel.get("title")
        assert title and panel["type"] in PANEL_TYPES, panel
        grid = panel["gridPos"]
        assert all(isinstance(grid[k], int) for k in "hwxy") and 0 <= grid["x"] and grid["x"] + grid["w"] <= 24, title
        assert panel["datasource"]["uid"] == uid, f"{title}: not on the provisioned data source"
        assert panel["targets"], f"{title} has no query"
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), title
        for target in panel["targets"]:
            assert target["expr"].strip() and target["datasource"]["uid"] == uid, title
            assert metric_names(target["expr"]), f"{title}: {target['expr']!r} selects no metric"


def test_dashboard_covers_the_operators_questions():
    used = set().union(*map(metric_names, exprs()))
    for name in ("kvfleet_scheduler_buffered_jobs", "kvfleet_scheduler_consumer_lag_messages",  # queues
                 "kvfleet_scheduler_jobs_total", "kvfleet_api_jobs_refused_total",  # admission
                 "kvfleet_scheduler_budget_in_use_tokens", "kvfleet_scheduler_budget_capacity_tokens",
                 "kvfleet_engine_time_to_first_token_seconds_bucket",
                 "kvfleet_engine_time_per_output_token_seconds_bucket",
                 "kvfleet_engine_prefix_cache_hits_total", "kvfleet_kv_cold_lookup_blocks_total",  # hot, cold
                 "kvfleet_kv_cold_loaded_bytes_total", "up"):
        assert name in used, f"no panel shows {name}"
    quantiles = [e for e in exprs() if "histogram_quantile" in e]
    assert quantiles and all("_bucket" in e and "le" in e for e in quantiles)


def test_provisioning_and_scrape_config_match_compose_and_settings():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    grafana_mounts = {v.split(":")[0]: v.split(":")[1] for v in compose["services"]["grafana"]["volumes"]}
    provider = yaml.safe_load((DEPLOY / "grafana" / "provisioning" / "dashboards" / "kvfleet.yml").read_text())
    assert provider["providers"][0]["options"]["path"] == grafana_mounts["./deploy/grafana/dashboards"]
    assert grafana_mounts["./deploy/grafana/provisioning"] == "/etc/grafana/provisioning"
    prom_mounts = compose["services"]["prometheus"]["volumes"]
    assert "./deploy/prometheus/prometheus.yml:/etc/prometheus/prometheus.yml:ro" in prom_mounts
    scrape = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    targets = {}
    for job in scrape["scrape_configs"]:
        for sd in job.get("static_configs", []):
            targets.update({t.split(":")[0]: int(t.split(":")[1]) for t in sd["targets"]})
        for sd in job.get("dns_sd_configs", []):
            targets.update({name: sd["port"] for name in sd["names"]})
    defaults = Settings()
    assert targets == {"api": defaults.api.port, "scheduler": defaults.scheduler.metrics_port,
                       "worker": defaults.worker.metrics_port}
    assert set(targets) <= set(compose["services"])


def exposed(text: str) -> set[str]:
    """The sample names in one /metrics answer (a histogram's _bucket, _sum, _count)."""
    return {s.name for family in text_string_to_metric_families(text) for s in family.samples}


def test_every_metric_on_the_dashboard_is_exposed_by_the_live_services(make_fleet):
    scheduler_port, worker_port = free_port(), free_port()
    fleet = make_fleet(workers=1, extra_env={"KVFLEET_SCHEDULER_METRICS_PORT": str(scheduler_port),
                                             "KVFLEET_WORKER_METRICS_PORT": str(worker_port)})
    # Samples for the labelled series too: two jobs sharing a 3-block prompt (the first
    # looks its blocks up in the cold tier, the second finds them in the pool), one
    # refusal (422: over the class's ceiling) and one undecodable Kafka record.
    ids = [fleet.submit("normal", prompt_len=48, max_new_tokens=6) for _ in range(2)]
    assert httpx.post(f"{fleet.url}/v1/jobs", headers={"X-Tenant-ID": "acme"},
                      json={"prompt_tokens": [7] * 8, "max_new_tokens": 100_000}).status_code == 422
    producer = KafkaProducer(bootstrap_servers=fleet.env["KVFLEET_KAFKA_BOOTSTRAP"], acks="all")
    producer.send(f"{fleet.prefix}.requests.normal", key=b"acme", value=b"{not json").get(10)
    producer.close()
    for job_id in ids:
        fleet.wait_for(lambda: fleet.state(job_id) == "done", f"job {job_id} done", timeout=120)
    fleet.wait_for(lambda: any(k.startswith("kvfleet_scheduler_dead_lettered_total")
                               for k in fleet.metrics(scheduler_port)), "the record dead-lettered")

    live = set(SCRAPE_SERIES)
    for url in (f"{fleet.url}/metrics", f"http://127.0.0.1:{scheduler_port}/metrics",
                f"http://127.0.0.1:{worker_port}/metrics"):
        live |= exposed(httpx.get(url, timeout=5).text)
    missing = {f"{name} (in {expr!r})" for expr in exprs() for name in metric_names(expr) if name not in live}
    assert not missing, "dashboard metrics no service exposes:\n" + "\n".join(sorted(missing))
