"""The feeder stage: `python -m consumers.feeder --config JOB.yaml` (see rollart.stages.feeder)."""

from consumers import run

if __name__ == "__main__":
    run("feeder")
