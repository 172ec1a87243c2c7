"""The eval stage: `python -m consumers.eval --config JOB.yaml` (see rollart.stages.evaluation)."""

from consumers import run

if __name__ == "__main__":
    run("eval")
