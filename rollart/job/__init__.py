"""The jobs run on this machine: ``rollart run`` (all stages as supervised processes, ``run.py``) and
its report, ``rollart rollout`` (``rollout.py``), ``rollart scale``; their machinery is :mod:`rollart.local`."""
