"""The topic catalog (``topics/*.yaml``) and applying it to a broker."""

from rollart.topics.catalog import (
    DLQ_SUFFIX,
    PhysicalTopic,
    TopicNames,
    TopicSpec,
    expand_catalog,
    load_catalog,
    spec_for,
)

__all__ = ["DLQ_SUFFIX", "PhysicalTopic", "TopicNames", "TopicSpec", "expand_catalog", "load_catalog", "spec_for"]
