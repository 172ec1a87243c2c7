"""The trainer stage: `python -m consumers.trainer --config JOB.yaml [--resume]` (see rollart.stages.trainer)."""

from consumers import run

if __name__ == "__main__":
    run("trainer")
