"""One runnable entry per consumer group: ``python -m consumers.<stage> --config JOB.yaml``.

Each is `rollart consume <stage>`; Kubernetes Deployments run these modules. The stage code lives in
``rollart.stages``; the bus loop it runs on in ``rollart.bus``.

| module | consumer group(s) | consumes | produces |
|---|---|---|---|
| feeder | (producer only) | policy version, admission counters | tasks |
| env | env, env-actions | tasks, env.actions | gen.requests.<pool>, trajectories.completed |
| generation | gen-<pool> | gen.requests.<pool> (+ policy.versions, no group) | env.actions (owner's partition) |
| envgen | env, env-actions, gen-<pool> | what env and generation consume (``env.colocate_pool``: the two in one process) | what they produce |
| reward | reward | trajectories.completed | rewards.results |
| trainer | trainer | rewards.results | policy.versions (+ weight buckets in Mooncake / fs) |
| eval | eval | eval.results (+ policy.versions, no group) | tasks (eval tasks pinned to a version), eval.summaries |
"""


def run(stage: str) -> None:
    import sys

    from rollart.cli import app

    app(["consume", stage, *sys.argv[1:]], prog_name=f"python -m consumers.{stage}")
