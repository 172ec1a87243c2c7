"""Stage users and their ACLs on a Kafka cluster, from :mod:`rollart.topics.access`.

aiokafka has no ACL or SCRAM-credential admin calls (and Kafka 4 refuses the old CreateAcls versions
its protocol module knows), so this uses confluent-kafka's AdminClient (librdkafka). On Strimzi the
same access is rendered as ``KafkaUser`` resources instead (rollart.deploy.objects.kafka_user).
"""

from __future__ import annotations

from typing import Iterable

from rollart.config import KafkaConfig
from rollart.topics.access import StageAccess

SCRAM_ITERATIONS = 4096


def admin_client(kafka: KafkaConfig, bootstrap: str):
    from confluent_kafka.admin import AdminClient

    return AdminClient(librdkafka_config(kafka, bootstrap))


def librdkafka_config(kafka: KafkaConfig, bootstrap: str) -> dict[str, str]:
    """The same connection settings as rollart.endpoints.kafka_client_kwargs, in librdkafka's names."""
    config = {"bootstrap.servers": bootstrap, "security.protocol": kafka.security_protocol,
              "socket.timeout.ms": str(kafka.request_timeout_ms)}
    if kafka.ssl_cafile:
        config["ssl.ca.location"] = str(kafka.ssl_cafile)
    if kafka.ssl_certfile:
        config["ssl.certificate.location"] = str(kafka.ssl_certfile)
    if kafka.ssl_keyfile:
        config["ssl.key.location"] = str(kafka.ssl_keyfile)
    if kafka.security_protocol.startswith("SASL"):
        config["sasl.mechanism"] = kafka.sasl_mechanism or "PLAIN"
        config["sasl.username"] = kafka.sasl_username or ""
        config["sasl.password"] = kafka.sasl_password.get_secret_value() if kafka.sasl_password else ""
    return config


def upsert_scram_users(admin, passwords: dict[str, str], timeout_s: float = 30.0) -> None:
    """Create or update SCRAM-SHA-512 credentials, one per user."""
    from confluent_kafka.admin import ScramCredentialInfo, ScramMechanism, UserScramCredentialUpsertion

    info = ScramCredentialInfo(ScramMechanism.SCRAM_SHA_512, SCRAM_ITERATIONS)
    alterations = [UserScramCredentialUpsertion(user, info, password.encode()) for user, password in passwords.items()]
    for future in admin.alter_user_scram_credentials(alterations, request_timeout=timeout_s).values():
        future.result()
    _wait_for_users(admin, list(passwords), timeout_s)


def _wait_for_users(admin, users: list[str], timeout_s: float) -> None:
    """The controller has accepted the credentials; brokers apply them from the metadata log a little
    later (a login right away can still be refused). Wait until the broker describes every one."""
    import time

    from confluent_kafka import KafkaException

    deadline = time.monotonic() + timeout_s
    pending = list(users)
    while pending:
        futures = admin.describe_user_scram_credentials(pending, request_timeout=timeout_s)
        missing = []
        for user, future in futures.items():
            try:
                future.result()
            except KafkaException:
                missing.append(user)
        pending = missing
        if pending and time.monotonic() > deadline:
            raise TimeoutError(f"SCRAM credentials of {pending} not visible on the broker after {timeout_s}s")
        if pending:
            time.sleep(0.1)


def acl_bindings(access: StageAccess) -> list:
    """Read+Describe on what it reads, Write+Describe on what it writes, Read on its groups."""
    from confluent_kafka.admin import AclBinding, AclOperation, AclPermissionType, ResourcePatternType, ResourceType

    principal = f"User:{access.principal}"

    def allow(kind, name: str, operation) -> AclBinding:
        return AclBinding(kind, name, ResourcePatternType.LITERAL, principal, "*", operation, AclPermissionType.ALLOW)

    bindings = []
    for topic in access.read:
        bindings += [allow(ResourceType.TOPIC, topic, AclOperation.READ),
                     allow(ResourceType.TOPIC, topic, AclOperation.DESCRIBE)]
    for topic in access.write:
        bindings += [allow(ResourceType.TOPIC, topic, AclOperation.WRITE),
                     allow(ResourceType.TOPIC, topic, AclOperation.DESCRIBE)]
    bindings += [allow(ResourceType.GROUP, group, AclOperation.READ) for group in access.groups]
    return list({(b.restype, b.name, b.operation): b for b in bindings}.values())


def grant(admin, accesses: Iterable[StageAccess], timeout_s: float = 30.0) -> int:
    """Create every stage's ACLs (creating an existing ACL is a no-op); returns how many."""
    bindings = [b for access in accesses for b in acl_bindings(access)]
    for future in admin.create_acls(bindings, request_timeout=timeout_s).values():
        future.result()
    return len(bindings)
