"""The reward stage: `python -m consumers.reward --config JOB.yaml` (see rollart.stages.reward)."""

from consumers import run

if __name__ == "__main__":
    run("reward")
