"""An env member and a generation member in one process (``env.colocate_pool``): `python -m consumers.envgen --config JOB.yaml --pool NAME` (see rollart.stages.envgen)."""

from consumers import run

if __name__ == "__main__":
    run("envgen")
