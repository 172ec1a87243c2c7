"""The local job: what runs a job on this machine, shared by `rollart run`, `rollart rollout`, chaos,
soak and the benchmarks (the library packages never import it, except its two leaves).

* the stack: ``brokers.py`` (Apache Kafka as a KRaft node, or Tansu), ``security.py`` (a SASL_SSL
  Kafka with ACLs), ``stack.py`` (the services, `rollart local up/down`), ``state.py`` (its state
  file, a leaf: endpoint resolution reads it when no endpoint is configured), ``http_server.py``;
* ``endpoints.py``: a run's endpoints (configured, recorded, or a stack of its own) and its config;
* ``processes.py``: each stage member a process; ``children.py`` (a leaf): children that die with
  their parent;
* ``supervision.py``: starting the stages, restarting the dead ones, the CPU plan;
* ``observer.py``: the run observer, counting what the stages report.
"""
