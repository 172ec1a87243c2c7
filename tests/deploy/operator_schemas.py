"""JSON schemas for the operator resources rollart renders, written from the operators' docs.

kubernetes-validate knows the built-in kinds only. These schemas hold what each operator needs to
act on a resource (required fields, types, enums and bounds as the CRDs declare them) for the
fields we set: KEDA 2.x ScaledObject / TriggerAuthentication and its Kafka scaler's metadata,
Strimzi KafkaTopic and KafkaUser (v1beta2), Prometheus-operator PodMonitor (v1). ``additionalProperties: false``
where we set fields, so a typo in a field name fails.
"""

from __future__ import annotations

NAME = {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", "maxLength": 63}
STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}


def _resource(api_version: str, kind: str, spec: dict, *, metadata_required=("name", "namespace"),
              labels_required=()) -> dict:
    labels: dict = dict(STRING_MAP)
    if labels_required:
        labels = {**labels, "required": list(labels_required)}
    return {
        "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"], "additionalProperties": False,
        "properties": {
            "apiVersion": {"const": api_version}, "kind": {"const": kind},
            "metadata": {"type": "object", "required": list(metadata_required),
                         "properties": {"name": NAME, "namespace": NAME, "labels": labels,
                                        "annotations": STRING_MAP}},
            "spec": spec,
        },
    }


KAFKA_SCALER_METADATA = {
    "type": "object", "additionalProperties": {"type": "string"},  # KEDA trigger metadata is map[string]string
    "required": ["bootstrapServers", "consumerGroup", "topic", "lagThreshold"],
    "properties": {
        "lagThreshold": {"type": "string", "pattern": r"^[1-9][0-9]*$"},
        "activationLagThreshold": {"type": "string", "pattern": r"^[0-9]+$"},
        "offsetResetPolicy": {"enum": ["earliest", "latest"]},
        "allowIdleConsumers": {"enum": ["true", "false"]},
        "sasl": {"enum": ["plaintext", "scram_sha256", "scram_sha512", "oauthbearer", "gssapi", "none"]},
        "tls": {"enum": ["enable", "disable"]},
    },
}

PROMETHEUS_SCALER_METADATA = {  # KEDA's prometheus scaler: a query whose value per replica is the target
    "type": "object", "additionalProperties": {"type": "string"},
    "required": ["serverAddress", "query", "threshold"],
    "properties": {
        "serverAddress": {"type": "string", "pattern": r"^https?://"},
        "threshold": {"type": "string", "pattern": r"^[0-9]+(\.[0-9]+)?$"},
        "activationThreshold": {"type": "string", "pattern": r"^[0-9]+(\.[0-9]+)?$"},
    },
}

AUTHENTICATION_REF = {"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}}

SCALED_OBJECT = _resource("keda.sh/v1alpha1", "ScaledObject", {
    "type": "object", "required": ["scaleTargetRef", "triggers"], "additionalProperties": False,
    "properties": {
        "scaleTargetRef": {"type": "object", "required": ["name"], "additionalProperties": False,
                           "properties": {"apiVersion": {"type": "string"}, "kind": {"type": "string"},
                                          "name": {"type": "string"}}},
        "minReplicaCount": {"type": "integer", "minimum": 0},
        "maxReplicaCount": {"type": "integer", "minimum": 1},
        "pollingInterval": {"type": "integer", "minimum": 1},
        "cooldownPeriod": {"type": "integer", "minimum": 0},
        "triggers": {"type": "array", "minItems": 1, "items": {"oneOf": [
            {"type": "object", "required": ["type", "metadata"], "additionalProperties": False,
             "properties": {"type": {"const": "kafka"}, "name": {"type": "string"},
                            "metadata": KAFKA_SCALER_METADATA, "authenticationRef": AUTHENTICATION_REF}},
            {"type": "object", "required": ["type", "metadata"], "additionalProperties": False,
             "properties": {"type": {"const": "prometheus"}, "name": {"type": "string"},
                            "metadata": PROMETHEUS_SCALER_METADATA, "authenticationRef": AUTHENTICATION_REF}},
        ]}},
    },
})

TRIGGER_AUTHENTICATION = _resource("keda.sh/v1alpha1", "TriggerAuthentication", {
    "type": "object", "additionalProperties": False,
    "properties": {"secretTargetRef": {"type": "array", "minItems": 1, "items": {
        "type": "object", "required": ["parameter", "name", "key"], "additionalProperties": False,
        "properties": {"parameter": {"enum": ["username", "password", "ca", "cert", "key", "sasl", "tls"]},
                       "name": {"type": "string"}, "key": {"type": "string"}}}}},
})

KAFKA_TOPIC = _resource("kafka.strimzi.io/v1beta2", "KafkaTopic", {
    "type": "object", "required": ["partitions", "replicas"], "additionalProperties": False,
    "properties": {
        "topicName": {"type": "string", "pattern": r"^[A-Za-z0-9._-]{1,249}$"},
        "partitions": {"type": "integer", "minimum": 1},
        "replicas": {"type": "integer", "minimum": 1, "maximum": 32767},
        "config": {"type": "object", "additionalProperties": {"type": ["string", "integer", "boolean", "number"]}},
    },
}, labels_required=("strimzi.io/cluster",))  # the Topic Operator watches only its cluster's label

KAFKA_USER = _resource("kafka.strimzi.io/v1beta2", "KafkaUser", {
    "type": "object", "additionalProperties": False,
    "properties": {
        "authentication": {"type": "object", "required": ["type"], "additionalProperties": False,
                           "properties": {"type": {"enum": ["tls", "tls-external", "scram-sha-512"]}}},
        "authorization": {"type": "object", "required": ["type", "acls"], "additionalProperties": False,
                          "properties": {"type": {"const": "simple"}, "acls": {"type": "array", "items": {
                              "type": "object", "required": ["resource", "operations"], "additionalProperties": False,
                              "properties": {
                                  "resource": {"type": "object", "required": ["type"], "additionalProperties": False,
                                               "properties": {
                                                   "type": {"enum": ["topic", "group", "cluster", "transactionalId"]},
                                                   "name": {"type": "string"},
                                                   "patternType": {"enum": ["literal", "prefix"]}}},
                                  "operations": {"type": "array", "minItems": 1, "items": {"enum": [
                                      "Read", "Write", "Create", "Delete", "Alter", "Describe", "ClusterAction",
                                      "AlterConfigs", "DescribeConfigs", "IdempotentWrite", "All"]}},
                                  "host": {"type": "string"},
                                  "type": {"enum": ["allow", "deny"]}}}}}},
    },
}, labels_required=("strimzi.io/cluster",))  # the User Operator watches only its cluster's label

POD_MONITOR = _resource("monitoring.coreos.com/v1", "PodMonitor", {
    "type": "object", "required": ["selector", "podMetricsEndpoints"], "additionalProperties": False,
    "properties": {
        "selector": {"type": "object", "properties": {"matchLabels": STRING_MAP}, "minProperties": 1},
        "podMetricsEndpoints": {"type": "array", "minItems": 1, "items": {
            "type": "object", "required": ["port"], "additionalProperties": False,
            "properties": {"port": {"type": "string"}, "path": {"type": "string"}, "honorLabels": {"type": "boolean"},
                           "interval": {"type": "string", "pattern": r"^(0|(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"}}}},
    },
})

SCHEMAS = {"ScaledObject": SCALED_OBJECT, "TriggerAuthentication": TRIGGER_AUTHENTICATION,
           "KafkaTopic": KAFKA_TOPIC, "KafkaUser": KAFKA_USER, "PodMonitor": POD_MONITOR}
