"""The env stage: `python -m consumers.env --config JOB.yaml` (see rollart.stages.env)."""

from consumers import run

if __name__ == "__main__":
    run("env")
