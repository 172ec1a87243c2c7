"""The generation stage: `python -m consumers.generation --config JOB.yaml --pool NAME` (see rollart.stages.generation)."""

from consumers import run

if __name__ == "__main__":
    run("generation")
