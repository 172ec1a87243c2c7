"""Write dashboards/*.json (Grafana, provisionable) from the panel lists below.

Every query must use a metric the code exports: tests/test_dashboards.py checks it.
Run: .venv/bin/python scripts/make_dashboards.py
"""

import json
from pathlib import Path

J = 'job="$job"'
OUT = Path(__file__).resolve().parents[1] / "dashboards"


def panel(i, title, exprs, unit="short"):
    return {"id": i, "type": "timeseries", "title": title,
            "datasource": {"type": "prometheus", "uid": "${datasource}"},
            "gridPos": {"h": 8, "w": 12, "x": 12 * ((i - 1) % 2), "y": 8 * ((i - 1) // 2)},
            "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
            "targets": [{"refId": chr(65 + n), "expr": e, "legendFormat": legend} for n, (e, legend) in enumerate(exprs)]}


def quantiles(metric, by):
    return [(f'histogram_quantile({q}, sum by (le, {by}) (rate({metric}_bucket{{{J}}}[5m])))', f"p{int(q * 100)} {{{{{by}}}}}")
            for q in (0.5, 0.99)]


def dashboard(uid, title, panels, job_metric):
    return {"title": title, "uid": uid, "schemaVersion": 39, "version": 1, "editable": True,
            "time": {"from": "now-30m", "to": "now"}, "refresh": "10s", "tags": ["rollart"],
            "templating": {"list": [
                {"name": "datasource", "type": "datasource", "query": "prometheus"},
                {"name": "job", "type": "query", "datasource": {"type": "prometheus", "uid": "${datasource}"},
                 "query": f"label_values({job_metric}, job)", "refresh": 2}]},
            "panels": panels}


BUS = [
    panel(1, "Consumer lag by group and topic", [(f'sum by (group, topic) (rollart_bus_consumer_lag_messages{{{J}}})', "{{group}} {{topic}}")]),
    panel(2, "Messages processed / s", [(f'sum by (group, topic) (rate(rollart_bus_messages_processed_total{{{J}}}[1m]))', "{{group}} {{topic}}")], "ops"),
    panel(3, "Handler latency p50 / p99", quantiles("rollart_bus_handler_latency_seconds", "group"), "s"),
    panel(4, "Failures / s by reason", [(f'sum by (group, reason) (rate(rollart_bus_messages_failed_total{{{J}}}[5m]))', "{{group}} {{reason}}")], "ops"),
    panel(5, "Dead-lettered / s", [(f'sum by (group, topic) (rate(rollart_bus_messages_dead_lettered_total{{{J}}}[5m]))', "{{group}} {{topic}}")], "ops"),
    panel(6, "Duplicates dropped / s", [(f'sum by (group, topic) (rate(rollart_bus_messages_deduplicated_total{{{J}}}[5m]))', "{{group}} {{topic}}")], "ops"),
    panel(7, "In flight and backpressure", [(f'sum by (group) (rollart_bus_in_flight_messages{{{J}}})', "in flight {{group}}"),
                                            (f'max by (group) (rollart_bus_paused{{{J}}})', "paused {{group}}")]),
    panel(8, "Seconds since each loop polled (liveness)", [(f'time() - max by (group) (rollart_bus_last_poll_timestamp_seconds{{{J}}})', "{{group}}")], "s"),
    panel(9, "Messages produced / s", [(f'sum by (topic) (rate(rollart_bus_messages_produced_total{{{J}}}[1m]))', "{{topic}}")], "ops"),
]

ROLLOUT = [
    panel(1, "Trajectories completed / s by tag", [(f'sum by (tag) (rate(rollart_env_trajectories_completed_total{{{J}}}[1m]))', "{{tag}}")], "ops"),
    panel(2, "Aborts / s by reason", [(f'sum by (reason) (rate(rollart_env_trajectories_aborted_total{{{J}}}[5m]))', "{{reason}}")], "ops"),
    panel(3, "Trajectory latency p50 / p99", quantiles("rollart_env_trajectory_latency_seconds", "tag"), "s"),
    panel(4, "Turns per trajectory p50 / p99", quantiles("rollart_env_trajectory_turns", "tag")),
    panel(5, "env.reset latency p50 / p99", quantiles("rollart_env_reset_latency_seconds", "tag"), "s"),
    panel(6, "env.step latency p50 / p99", quantiles("rollart_env_step_latency_seconds", "tag"), "s"),
    panel(7, "Generation tokens / s by pool", [(f'sum by (pool) (rate(rollart_generation_tokens_total{{{J}}}[1m]))', "{{pool}}")]),
    panel(8, "Generation request latency p50 / p99", quantiles("rollart_generation_request_latency_seconds", "pool"), "s"),
    panel(9, "Pool fallbacks / s", [(f'sum by (tag, from_pool, to_pool) (rate(rollart_env_pool_fallbacks_total{{{J}}}[5m]))', "{{tag}} {{from_pool}}→{{to_pool}}")], "ops"),
    panel(10, "Running trajectories and requests", [(f'sum(rollart_env_running_trajectories{{{J}}})', "trajectories"),
                                                    (f'sum by (pool) (rollart_generation_running_requests{{{J}}})', "requests {{pool}}")]),
    panel(11, "Reward latency p50 / p99", quantiles("rollart_reward_latency_seconds", "type"), "s"),
    panel(12, "Reward failures / s", [(f'sum by (tag, type) (rate(rollart_reward_failures_total{{{J}}}[5m]))', "{{tag}} {{type}}")], "ops"),
    panel(13, "Groups / s by outcome", [(f'sum by (outcome) (rate(rollart_env_groups_total{{{J}}}[5m]))', "{{outcome}}")], "ops"),
    panel(14, "Feeder: groups released / s and admission blocked", [
        (f'sum by (tag) (rate(rollart_feeder_groups_released_total{{{J}}}[1m]))', "released {{tag}}"),
        (f'max(rollart_feeder_admission_blocked{{{J}}})', "blocked")]),
    panel(15, "Bus overhead per LLM turn p50 / p99 (round trip minus engine time)",
          quantiles("rollart_env_generation_overhead_seconds", "pool"), "s"),
]

TRAINING = [
    panel(1, "Batch reward (mean) and policy version", [(f'max(rollart_trainer_batch_reward_mean{{{J}}})', "reward"),
                                                        (f'max(rollart_trainer_policy_version{{{J}}})', "trainer version"),
                                                        (f'min by (pool) (rollart_generation_policy_version{{{J}}})', "engines {{pool}} (min)")]),
    panel(2, "Training steps and samples / s", [(f'sum(rate(rollart_trainer_steps_total{{{J}}}[1m]))', "steps"),
                                                (f'sum(rate(rollart_trainer_samples_total{{{J}}}[1m]))', "samples")], "ops"),
    panel(3, "Step time by phase p50 / p99", quantiles("rollart_trainer_step_phase_seconds", "phase"), "s"),
    panel(4, "Staleness of trained samples p50 / p99 (versions)", [
        (f'histogram_quantile({q}, sum by (le) (rate(rollart_trainer_sample_staleness_versions_bucket{{{J}}}[5m])))', f"p{int(q * 100)}")
        for q in (0.5, 0.99)]),
    panel(5, "Weight publish p50 / p99", quantiles("rollart_trainer_weight_publish_seconds", "transport"), "s"),
    panel(6, "Weight pull (background) p50 / p99", quantiles("rollart_generation_weight_pull_seconds", "pool"), "s"),
    panel(7, "Weight load (exposed pause) p50 / p99", quantiles("rollart_generation_weight_load_seconds", "pool"), "s"),
    panel(8, "Buffer groups and samples dropped / s by reason", [
        (f'max(rollart_trainer_buffer_groups{{{J}}})', "buffer groups"),
        (f'sum by (reason) (rate(rollart_trainer_dropped_total{{{J}}}[5m]))', "dropped {{reason}}")]),
]

if __name__ == "__main__":
    (OUT / "training.json").write_text(json.dumps(dashboard("rollart-training", "rollart — training", TRAINING,
                                                            "rollart_trainer_steps_total"), indent=2) + "\n")
    (OUT / "bus.json").write_text(json.dumps(dashboard("rollart-bus", "rollart — event bus", BUS,
                                                       "rollart_bus_messages_processed_total"), indent=2) + "\n")
    (OUT / "rollout.json").write_text(json.dumps(dashboard("rollart-rollout", "rollart — rollout", ROLLOUT,
                                                           "rollart_env_trajectories_completed_total"), indent=2) + "\n")
