"""rollart: disaggregated multi-task agentic RL on Kafka consumer groups."""

__version__ = "0.1.0"
