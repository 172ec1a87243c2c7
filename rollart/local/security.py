"""A secured local Apache Kafka: a throwaway CA, a certificate the broker serves itself, SCRAM users.

``LocalSecurity.create(folder)`` writes ``ca.pem`` (clients trust it), ``keystore.pem`` (the broker's
key and certificate for 127.0.0.1 / localhost, Kafka's PEM keystore layout) and ``admin.json`` (the
super user's password, mode 0600). The broker then speaks only SASL_SSL with SCRAM-SHA-512 and
enforces ACLs (see :class:`rollart.local.brokers.BrokerSasl`); stage users and their ACLs are added
through :mod:`rollart.topics.acls`.
"""

from __future__ import annotations

import json
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from rollart.local.brokers import BrokerSasl, BrokerTls

if TYPE_CHECKING:
    from rollart.config import RollartConfig

ADMIN_USER = "admin"


@dataclass(frozen=True)
class LocalSecurity:
    folder: Path

    @property
    def ca(self) -> Path:
        return self.folder / "ca.pem"

    @property
    def keystore(self) -> Path:
        return self.folder / "keystore.pem"

    @property
    def admin_password(self) -> str:
        return json.loads((self.folder / "admin.json").read_text())["password"]

    @classmethod
    def create(cls, folder: Path) -> "LocalSecurity":
        """The CA, the broker's keystore and the admin's password; kept if the folder has them (a
        broker's formatted log holds the admin credential it was formatted with)."""
        security = cls(Path(folder))
        if not (security.ca.exists() and security.keystore.exists() and (security.folder / "admin.json").exists()):
            security._write()
        return security

    def _write(self) -> None:
        import trustme
        from cryptography.hazmat.primitives import serialization

        self.folder.mkdir(parents=True, exist_ok=True)
        ca = trustme.CA(organization_name="rollart local stack")
        server = ca.issue_cert("127.0.0.1", "localhost")
        key = serialization.load_pem_private_key(server.private_key_pem.bytes(), password=None)
        pkcs8 = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption())
        ca.cert_pem.write_to_path(str(self.ca))
        _write_private(self.keystore, pkcs8 + b"".join(pem.bytes() for pem in server.cert_chain_pems))
        _write_private(self.folder / "admin.json", json.dumps({"user": ADMIN_USER,
                                                               "password": secrets.token_urlsafe(24)}).encode())

    def broker_tls(self) -> BrokerTls:
        return BrokerTls(self.keystore, self.ca)

    def broker_sasl(self) -> BrokerSasl:
        return BrokerSasl(ADMIN_USER, self.admin_password)

    def kafka_config(self, user: str = ADMIN_USER, password: str | None = None) -> dict[str, str]:
        """The ``kafka`` section (less the bootstrap) a client of this broker uses, as ``user``."""
        return {"security_protocol": "SASL_SSL", "sasl_mechanism": BrokerSasl.MECHANISM, "sasl_username": user,
                "sasl_password": self.admin_password if password is None else password, "ssl_cafile": str(self.ca)}

    def stage_env(self, user: str, password: str) -> dict[str, str]:
        """The same settings as environment for a stage process (ROLLART_KAFKA_*)."""
        return {f"ROLLART_KAFKA_{key.upper()}": value for key, value in self.kafka_config(user, password).items()}

    def secure_job(self, config: RollartConfig, bootstrap: str) -> dict[tuple[str, str | None], tuple[str, str]]:
        """A SCRAM user with a fresh password and its ACLs for every stage of ``config``'s job (its
        topics exist); returns (stage, pool) -> (user, password)."""
        from rollart.config import KafkaConfig
        from rollart.topics.access import job_access
        from rollart.topics.acls import admin_client, grant, upsert_scram_users

        accesses = job_access(config)
        logins = {(a.stage, a.pool): (a.principal, secrets.token_urlsafe(18)) for a in accesses}
        admin = admin_client(KafkaConfig(**self.kafka_config()), bootstrap)
        upsert_scram_users(admin, dict(logins.values()))
        grant(admin, accesses)
        return logins


def _write_private(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(data)
