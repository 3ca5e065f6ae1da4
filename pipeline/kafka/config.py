"""Where the event log lives and how to reach it.

One ``KafkaConfig`` is shared by the producer, the consumer loop, topic bootstrap and
the lag reader, so that a deployment names its cluster, credentials and topic layout
once. ``bootstrap_servers=None`` means "the embedded broker": whoever starts it fills
the address in, and the embedded broker's profile (``EmbeddedBroker.attach``).

Which broker a process talks to (``KafkaConfig.broker``): the embedded broker's
profile where it made the config; the kind ``--broker-kind`` names; or, by default,
the one the broker's cluster id shows, asked once per client (``pipeline.kafka.kind``).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from aiokafka.helpers import create_ssl_context

from pipeline.kafka.embedded.tansu import TANSU
from pipeline.kafka.profile import KAFKA, BrokerProfile
from pipeline.kafka.retention import TopicRetention, retention_arguments, retention_from_args
from topics.names import DEFAULT_PARTITIONS, DEFAULT_PREFIX, TopicNames

SecurityProtocol = Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"]
SaslMechanism = Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"]

SASL_PASSWORD_ENV = "TOKENTRAIL_KAFKA_SASL_PASSWORD"

BROKER_KINDS: dict[str, BrokerProfile] = {profile.kind: profile for profile in (KAFKA, TANSU)}
AUTO_KIND = "auto"


class _ArgumentSink(Protocol):
    """A parser or an argument group."""

    def add_argument(self, *names: str, **options: Any) -> argparse.Action: ...


class ConfigError(ValueError):
    """The configuration cannot be used as given."""


@dataclass(frozen=True, slots=True)
class KafkaConfig:
    """Connection, security and topic layout of one tokentrail event log."""

    bootstrap_servers: str | None = None
    client_id: str = "tokentrail"
    names: TopicNames = field(default_factory=TopicNames)
    retention: TopicRetention = field(default_factory=TopicRetention)
    """What topics are created with (``ensure_topics``); set by the verbs that create them."""
    replication_factor: int = 1
    request_timeout_ms: int = 30_000
    security_protocol: SecurityProtocol = "PLAINTEXT"
    sasl_mechanism: SaslMechanism | None = None
    sasl_plain_username: str | None = None
    sasl_plain_password: str | None = field(default=None, repr=False)
    ssl_cafile: str | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    broker: BrokerProfile | None = None
    """What the broker serves; ``None``: ask it (``pipeline.kafka.kind``)."""

    def __post_init__(self) -> None:
        if self.replication_factor < 1:
            raise ConfigError(f"replication_factor: must be >= 1, got {self.replication_factor}")
        if self.security_protocol.startswith("SASL") and self.sasl_mechanism is None:
            raise ConfigError(f"sasl_mechanism: required with security_protocol {self.security_protocol}")

    @property
    def embedded(self) -> bool:
        """True until an address is known: the embedded broker is meant."""
        return self.bootstrap_servers is None

    @property
    def bootstrap(self) -> str:
        if self.bootstrap_servers is None:
            raise ConfigError("bootstrap_servers: not set; start the embedded broker or pass --bootstrap")
        return self.bootstrap_servers

    def client_kwargs(self) -> dict[str, Any]:
        """Keyword arguments every aiokafka client (producer, consumer, admin) accepts."""
        kwargs: dict[str, Any] = {
            "bootstrap_servers": self.bootstrap,
            "client_id": self.client_id,
            "request_timeout_ms": self.request_timeout_ms,
            "security_protocol": self.security_protocol,
        }
        if self.sasl_mechanism is not None:
            kwargs["sasl_mechanism"] = self.sasl_mechanism
            kwargs["sasl_plain_username"] = self.sasl_plain_username
            kwargs["sasl_plain_password"] = self.sasl_plain_password
        if self.security_protocol in ("SSL", "SASL_SSL"):
            kwargs["ssl_context"] = create_ssl_context(
                cafile=self.ssl_cafile, certfile=self.ssl_certfile, keyfile=self.ssl_keyfile
            )
        return kwargs


def add_kafka_arguments(
    parser: argparse.ArgumentParser, *, bootstrap_required: bool = False, topic_layout: bool = True
) -> None:
    """The ``--bootstrap``/security/topic-layout flags shared by every verb that talks to Kafka."""
    group = parser.add_argument_group("Kafka")
    group.add_argument(
        "--bootstrap",
        required=bootstrap_required,
        metavar="HOST:PORT",
        help="Kafka bootstrap servers (comma separated)"
        + ("" if bootstrap_required else "; omit to use the embedded broker"),
    )
    group.add_argument(
        "--broker-kind",
        default=AUTO_KIND,
        choices=[AUTO_KIND, *sorted(BROKER_KINDS)],
        help="what the broker at --bootstrap is: Apache Kafka (or a broker keeping its contract) or "
        "tokentrail's embedded tansu broker; auto tells them apart by the cluster id (default: %(default)s)",
    )
    group.add_argument("--client-id", default="tokentrail", help="client id sent to the broker")
    if topic_layout:
        add_topic_layout_arguments(group)
    group.add_argument(
        "--security-protocol",
        default="PLAINTEXT",
        choices=["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"],
        help="how to talk to the brokers (default: %(default)s)",
    )
    group.add_argument(
        "--sasl-mechanism",
        choices=["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"],
        help="SASL mechanism; required with a SASL_* protocol",
    )
    group.add_argument("--sasl-username", help="SASL user (the password comes from the environment)")
    group.add_argument(
        "--sasl-password-env",
        default=SASL_PASSWORD_ENV,
        metavar="VAR",
        help="environment variable holding the SASL password (default: %(default)s)",
    )
    group.add_argument("--ssl-cafile", metavar="PATH", help="CA bundle that signed the brokers' certificates")
    group.add_argument("--ssl-certfile", metavar="PATH", help="client certificate (mutual TLS)")
    group.add_argument("--ssl-keyfile", metavar="PATH", help="client certificate's private key (mutual TLS)")


def add_topic_layout_arguments(parser: _ArgumentSink) -> None:
    """``--topic-prefix`` and ``--partitions``: the layout of the tokentrail topics."""
    parser.add_argument(
        "--topic-prefix", default=DEFAULT_PREFIX, help="topic name prefix (default: %(default)s)"
    )
    parser.add_argument(
        "--partitions",
        type=int,
        default=DEFAULT_PARTITIONS,
        help="partitions of every tokentrail topic (default: %(default)s)",
    )


def topic_names_from_args(args: argparse.Namespace) -> TopicNames:
    try:
        return TopicNames(
            prefix=getattr(args, "topic_prefix", DEFAULT_PREFIX),
            partitions=getattr(args, "partitions", DEFAULT_PARTITIONS),
        )
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def config_from_args(args: argparse.Namespace) -> KafkaConfig:
    """Build a ``KafkaConfig`` from flags added by ``add_kafka_arguments``."""
    names = topic_names_from_args(args)
    return KafkaConfig(
        bootstrap_servers=args.bootstrap,
        client_id=args.client_id,
        broker=BROKER_KINDS.get(args.broker_kind),
        names=names,
        retention=retention_from_args(getattr(args, "retention", None)),
        security_protocol=args.security_protocol,
        sasl_mechanism=args.sasl_mechanism,
        sasl_plain_username=args.sasl_username,
        sasl_plain_password=os.environ.get(args.sasl_password_env),
        ssl_cafile=args.ssl_cafile,
        ssl_certfile=args.ssl_certfile,
        ssl_keyfile=args.ssl_keyfile,
    )


def kafka_arguments(config: KafkaConfig) -> list[str]:
    """The flags of ``add_kafka_arguments`` that give ``config`` back to a child process
    (``config_from_args`` of them), with ``--retention`` where it is not the default (the
    child must take it: a stage does); the SASL password travels in ``kafka_environment``."""
    argv = [
        "--bootstrap", config.bootstrap,
        "--broker-kind", config.broker.kind if config.broker is not None else AUTO_KIND,
        "--client-id", config.client_id,
        "--topic-prefix", config.names.prefix,
        "--partitions", str(config.names.partitions),
        "--security-protocol", config.security_protocol,
    ]  # fmt: skip
    optional = {
        "--sasl-mechanism": config.sasl_mechanism,
        "--sasl-username": config.sasl_plain_username,
        "--ssl-cafile": config.ssl_cafile,
        "--ssl-certfile": config.ssl_certfile,
        "--ssl-keyfile": config.ssl_keyfile,
    }
    for flag, value in optional.items():
        if value is not None:
            argv += [flag, value]
    return argv + retention_arguments(config.retention)


def kafka_environment(config: KafkaConfig) -> dict[str, str]:
    """The environment a child needs besides ``kafka_arguments``: the SASL password,
    never on a command line where any user can read it."""
    if config.sasl_plain_password is None:
        return {}
    return {SASL_PASSWORD_ENV: config.sasl_plain_password}
