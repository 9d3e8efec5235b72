"""Typed sync and async clients of the DSec node API (``dsec.v1``)."""

from __future__ import annotations

import asyncio
import os
import queue
import time
import uuid
from dataclasses import dataclass, field
from typing import (Any, AsyncIterator, Dict, Iterable, Iterator, List, Mapping, Optional,
                    Sequence, Tuple, Union)

import grpc
import grpc.aio

from . import dsec_pb2 as pb
from . import dsec_pb2_grpc as rpc

#: Where the node daemon listens unless told otherwise (``DSEC_ENDPOINT`` overrides).
DEFAULT_TARGET = "unix:/run/dsec/edge/edge.sock"
_CHUNK = 1 << 20
_MAX_MESSAGE = 32 << 20
#: Read size of the streaming file helpers (small chunks keep their memory low).
_FILE_CHUNK = 256 << 10

Path = Union[str, bytes]
Command = Union[str, Sequence[str]]


def default_target() -> str:
    return os.environ.get("DSEC_ENDPOINT") or DEFAULT_TARGET


def _grpc_target(target: str) -> str:
    """``http://HOST:PORT`` -> ``HOST:PORT``; several addresses (apiserver replicas,
    comma-separated) -> one ``ipv4:``/``ipv6:`` target that gRPC balances over, going on on
    the others when one fails."""
    parts = [t.strip() for t in target.split(",") if t.strip()]
    parts = [p.split("://", 1)[1] if p.startswith(("http://", "https://")) else p
             for p in parts]
    if len(parts) == 1:
        return parts[0]
    scheme = "ipv6" if parts[0].startswith("[") else "ipv4"
    return f"{scheme}:" + ",".join(parts)


class _WithMetadata:
    """A stub method that sends the client's credentials with every call."""

    def __init__(self, method, metadata: Tuple[Tuple[str, str], ...]):
        self._method = method
        self._metadata = metadata

    def __call__(self, *args, metadata=None, **kwargs):
        # No positional request for an async stream-stream call (written to afterwards).
        return self._method(*args, metadata=tuple(metadata or ()) + self._metadata, **kwargs)

    def __getattr__(self, name):
        # with_call / future take the same arguments as a call.
        attr = getattr(self._method, name)
        if name in ("with_call", "future"):
            return _WithMetadata(attr, self._metadata)
        return attr


class _CredentialChannel:
    """A channel whose stubs send ``authorization: Bearer TOKEN`` and ``x-dsec-project``
    (what an apiserver needs; a lone node ignores them)."""

    def __init__(self, channel, metadata: Tuple[Tuple[str, str], ...]):
        self._channel = channel
        self._metadata = metadata

    def _wrap(self, kind: str):
        def make(*args, **kwargs):
            return _WithMetadata(getattr(self._channel, kind)(*args, **kwargs), self._metadata)
        return make

    def __getattr__(self, name):
        if name in ("unary_unary", "unary_stream", "stream_unary", "stream_stream"):
            return self._wrap(name)
        return getattr(self._channel, name)


def _credentials(token: Optional[str], project: Optional[str]) -> Tuple[str, Tuple[Tuple[str, str], ...]]:
    """The project and the metadata of every call, from the arguments or DSEC_TOKEN /
    DSEC_PROJECT."""
    token = token if token is not None else os.environ.get("DSEC_TOKEN", "")
    project = project if project is not None else os.environ.get("DSEC_PROJECT", "")
    metadata: List[Tuple[str, str]] = []
    if token:
        metadata.append(("authorization", f"Bearer {token}"))
    if project:
        metadata.append(("x-dsec-project", project))
    return project, tuple(metadata)


# ---------------------------------------------------------------- errors


class DsecError(Exception):
    """A call failed; ``code`` is the gRPC status code, ``details`` says what to fix."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


class InvalidArgument(DsecError, ValueError):
    """The request is malformed (also raised by the SDK itself before a call, e.g. for a
    negative timeout); a ValueError too."""


class NotFound(DsecError):
    pass


class ResourceExhausted(DsecError):
    pass


class FailedPrecondition(DsecError):
    pass


class Unavailable(DsecError):
    pass


class Unimplemented(DsecError):
    pass


class Unauthenticated(DsecError):
    """(apiserver) The API token is missing, malformed, unknown, revoked or expired."""


class PermissionDenied(DsecError):
    """(apiserver) The token's principal lacks the role the call needs on the project."""


_ERRORS = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.UNIMPLEMENTED: Unimplemented,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
}


def _error(e: grpc.RpcError) -> DsecError:
    code = e.code() if hasattr(e, "code") else grpc.StatusCode.UNKNOWN
    details = e.details() if hasattr(e, "details") else str(e)
    return _ERRORS.get(code, DsecError)(code, details or "")


# ---------------------------------------------------------------- results


@dataclass
class ExecResult:
    """How a command ended and what it wrote."""

    stdout: bytes
    stderr: bytes
    exit_code: Optional[int]
    signal: Optional[int]
    timed_out: bool

    @property
    def ok(self) -> bool:
        return self.exit_code == 0

    @property
    def text(self) -> str:
        return self.stdout.decode("utf-8", "replace")


@dataclass
class CommandResult:
    """A command run in a session. ``output`` is stdout+stderr, head and tail when truncated."""

    session_id: str
    command_id: int
    done: bool
    exit_code: Optional[int]
    timed_out: bool
    output: bytes
    truncated: bool
    total_bytes: int
    duration_ms: int
    session_ended: bool

    @property
    def text(self) -> str:
        return self.output.decode("utf-8", "replace")

    @classmethod
    def _from(cls, r: pb.CommandResult) -> "CommandResult":
        return cls(r.session_id, r.command_id, r.done,
                   r.exit_code if r.HasField("exit_code") else None, r.timed_out, r.output,
                   r.truncated, r.total_bytes, r.duration_ms, r.session_ended)


@dataclass
class FileInfo:
    name: str
    type: str
    size: int
    mode: int
    mtime_unix_ms: int
    symlink_target: str

    @classmethod
    def _from(cls, f: pb.FileInfo) -> "FileInfo":
        kind = pb.FileType.Name(f.type).removeprefix("FILE_TYPE_").lower()
        return cls(f.name, kind, f.size, f.mode, f.mtime_unix_ms, f.symlink_target)


@dataclass
class SandboxInfo:
    id: str
    backend: str
    image: str
    state: str
    vcpus: int
    memory_mib: int
    disk_mib: int
    pids_limit: int
    labels: Dict[str, str]
    created_at_unix_ms: int
    expires_at_unix_ms: int
    idle_timeout_seconds: int
    pid: int
    parent_id: str
    memory_bytes: int = 0
    cpu_usage_ns: int = 0
    pids: int = 0
    #: The memory cgroup's limit (memory + a container's tmpfs disk): what admission reserved.
    memory_limit_bytes: int = 0
    #: The request_id of the Create that made it.
    request_id: str = ""
    #: Secret for the sandbox's private ports (HTTP entry point, Ports.Open over TCP); set in
    #: what Create and Get return, empty in list() results.
    access_token: str = ""
    #: Ports open to everyone.
    public_ports: Tuple[int, ...] = ()
    #: State "dead": why its agent / VMM died (Get keeps showing it for 10 minutes).
    death_reason: str = ""

    @classmethod
    def _from(cls, s: pb.Sandbox) -> "SandboxInfo":
        return cls(s.id, pb.Backend.Name(s.backend).removeprefix("BACKEND_").lower(), s.image,
                   pb.SandboxState.Name(s.state).removeprefix("SANDBOX_STATE_").lower(),
                   s.vcpus, s.memory_mib, s.disk_mib, s.pids_limit, dict(s.labels),
                   s.created_at_unix_ms, s.expires_at_unix_ms, s.idle_timeout_seconds, s.pid,
                   s.parent_id, s.usage.memory_bytes, s.usage.cpu_usage_ns, s.usage.pids,
                   s.memory_limit_bytes, s.request_id, s.access_token, tuple(s.public_ports),
                   s.death_reason)


@dataclass
class Pty:
    """A pseudo-terminal for a command: ``rows`` x ``cols`` (each 1..4096; the node answers
    :class:`InvalidArgument` otherwise) and ``TERM`` (empty: "xterm"; an explicit ``TERM`` in
    ``env`` wins). On a PTY stdout and stderr arrive merged as stdout, with ``\\r\\n`` line
    ends, and byte 0x03 on stdin is Ctrl-C (SIGINT for the foreground process group)."""

    rows: int = 24
    cols: int = 80
    term: str = ""

    def _pb(self) -> pb.PtyConfig:
        return pb.PtyConfig(rows=self.rows, cols=self.cols, term=self.term)


#: One event of a streamed command: ``("stdout" | "stderr", data)``.
ExecEvent = Tuple[str, bytes]


# ---------------------------------------------------------------- request builders


@dataclass
class StageResult:
    """One stage (compile or run) of a :meth:`Client.run_code` call."""
    status: str  # "Finished", "TimeLimitExceeded" or "Error" (could not start)
    exit_code: Optional[int]
    signal: Optional[int]
    stdout: bytes
    stderr: bytes
    stdout_truncated: bool
    stderr_truncated: bool
    seconds: float

    @classmethod
    def _from(cls, r: pb.FnStageResult) -> "StageResult":
        status = {pb.FN_STAGE_STATUS_FINISHED: "Finished",
                  pb.FN_STAGE_STATUS_TIME_LIMIT_EXCEEDED: "TimeLimitExceeded"}.get(r.status, "Error")
        return cls(status, r.exit_code if r.HasField("exit_code") else None,
                   r.signal if r.HasField("signal") else None, r.stdout, r.stderr,
                   r.stdout_truncated, r.stderr_truncated, r.seconds)


@dataclass
class CodeResult:
    """What :meth:`Client.run_code` returns: ``run`` is None when compilation failed."""
    success: bool
    compile: Optional[StageResult]
    run: Optional[StageResult]
    files: Dict[str, bytes]
    file_errors: List[str]
    out_of_memory: bool
    total_seconds: float

    @property
    def stdout(self) -> str:
        return self.run.stdout.decode(errors="replace") if self.run else ""

    @property
    def stderr(self) -> str:
        stage = self.run or self.compile
        return stage.stderr.decode(errors="replace") if stage else ""

    @classmethod
    def _from(cls, r: pb.FnRunResponse) -> "CodeResult":
        return cls(r.success, StageResult._from(r.compile) if r.HasField("compile") else None,
                   StageResult._from(r.run) if r.HasField("run") else None, dict(r.files),
                   list(r.file_errors), r.out_of_memory, r.total_seconds)


def _run_code_request(code: str, language: str, stdin, files, fetch_files, compile_timeout,
                      run_timeout, memory_mib, network, image,
                      network_policy=None) -> pb.FnRunRequest:
    if isinstance(stdin, str):
        stdin = stdin.encode()
    req = pb.FnRunRequest(
        language=language, code=code, stdin=stdin or b"",
        files={k: (v.encode() if isinstance(v, str) else v) for k, v in (files or {}).items()},
        fetch_files=list(fetch_files), compile_timeout=compile_timeout, run_timeout=run_timeout,
        memory_mib=memory_mib, network=network, image=image)
    if network_policy is not None:
        req.network_policy.CopyFrom(_call_network_policy(network_policy))
    return req


def _call_network_policy(policy) -> pb.NetworkPolicy:
    """A call's policy: a ``pb.NetworkPolicy`` or a mapping with ``allow``, ``deny`` (rules
    and node policy names) and ``allow_internet``, as in SandboxFusion JSON's
    ``network_policy``."""
    if isinstance(policy, pb.NetworkPolicy):
        return policy
    if not isinstance(policy, Mapping):
        raise ValueError("network_policy is a mapping with allow, deny and allow_internet")
    unknown = set(policy) - {"allow", "deny", "allow_internet"}
    if unknown:
        raise ValueError(f"network_policy: unknown keys {sorted(unknown)} "
                         "(use allow, deny, allow_internet)")
    return _network_policy(policy.get("allow", ()), policy.get("deny", ()),
                           bool(policy.get("allow_internet", False)))


@dataclass
class PortUrl:
    """Where a sandbox port is served over plain HTTP by the node's HTTP entry point."""

    #: ``http://8080-sb-0123456789ab-TOKEN.localhost:7080/`` (``*.localhost`` is 127.0.0.1;
    #: no token for a public port).
    url: str
    #: The Host header that routes to the port (any domain suffix works).
    host: str
    #: Address the entry point listens on (``127.0.0.1:7080``).
    address: str
    #: The sandbox's access token, also for the ``X-Dsec-Access-Token`` header ("" for a
    #: public port).
    access_token: str = ""


def _check_port(port: int) -> None:
    # Checked here too so that a negative port is a clear error, not a serialization one.
    if not isinstance(port, int) or not 0 < port <= 65535:
        raise InvalidArgument(grpc.StatusCode.INVALID_ARGUMENT,
                              f"port {port!r} is not a TCP port: give 1-65535")


def _port_open(sandbox_id: str, port: int, token: str = "") -> pb.PortRequest:
    _check_port(port)
    return pb.PortRequest(open=pb.PortOpen(sandbox_id=sandbox_id, port=port,
                                           access_token=token))


def _port_data(data: bytes) -> Iterator[pb.PortRequest]:
    view = memoryview(data)
    for i in range(0, len(view), _CHUNK):
        yield pb.PortRequest(data=bytes(view[i:i + _CHUNK]))


_PORT_EOF = pb.PortRequest(eof=pb.PortEof())


def _path(p: Path) -> bytes:
    return p if isinstance(p, bytes) else p.encode("utf-8", "surrogateescape")


def _argv(command: Command) -> List[str]:
    if isinstance(command, str):
        return ["/bin/sh", "-c", command]
    return list(command)


def _network_policy(allow: Iterable[str], deny: Iterable[str],
                    allow_internet: bool) -> pb.NetworkPolicy:
    if isinstance(allow, str) or isinstance(deny, str):
        raise ValueError("allow and deny are lists of rules or policy names, not one string")
    return pb.NetworkPolicy(allow=list(allow), deny=list(deny), allow_internet=allow_internet)


_BACKENDS = {"": pb.BACKEND_UNSPECIFIED, "auto": pb.BACKEND_UNSPECIFIED,
             "container": pb.BACKEND_CONTAINER, "microvm": pb.BACKEND_MICROVM}


def _create_request(backend: str, image: str, vcpus: int, memory_mib: int, disk_mib: int,
                    env: Optional[Mapping[str, str]], ttl: int, idle_timeout: int,
                    labels: Optional[Mapping[str, str]], pids_limit: int,
                    allow_internet: bool, request_id: Optional[str],
                    public_ports: Iterable[int] = ()) -> pb.CreateSandboxRequest:
    if backend not in _BACKENDS:
        raise ValueError(f"backend {backend!r}: use 'container', 'microvm' or 'auto'")
    return pb.CreateSandboxRequest(
        backend=_BACKENDS[backend], image=image, vcpus=vcpus, memory_mib=memory_mib,
        disk_mib=disk_mib, env=dict(env or {}), ttl_seconds=ttl,
        idle_timeout_seconds=idle_timeout, labels=dict(labels or {}), pids_limit=pids_limit,
        network=pb.NetworkPolicy(allow_internet=allow_internet),
        request_id=request_id or uuid.uuid4().hex, public_ports=list(public_ports))


#: How often ``create`` tries when the node is unreachable (with the same request_id, so the
#: node never makes two sandboxes of one call).
CREATE_ATTEMPTS = 3

#: Most creates one CreateMany call carries (``create_many`` splits longer lists).
MAX_CREATES_PER_CALL = 256

_CODES = {c.value[0]: c for c in grpc.StatusCode}


def _create_many_requests(specs, project: str) -> List[pb.CreateSandboxesRequest]:
    """``create`` keyword arguments per sandbox -> CreateMany calls of at most
    MAX_CREATES_PER_CALL (each request with its own request_id, reused by a retry)."""
    reqs = []
    for spec in specs:
        spec = dict(spec)
        reqs.append(_create_request(
            spec.pop("backend", ""), spec.pop("image", ""), spec.pop("vcpus", 0),
            spec.pop("memory_mib", 0), spec.pop("disk_mib", 0), spec.pop("env", None),
            spec.pop("ttl", 0), spec.pop("idle_timeout", 0), spec.pop("labels", None),
            spec.pop("pids_limit", 0), spec.pop("allow_internet", False),
            spec.pop("request_id", None), spec.pop("public_ports", ())))
        if spec:
            raise InvalidArgument(grpc.StatusCode.INVALID_ARGUMENT,
                                  f"create_many: unknown create arguments {sorted(spec)}")
    return [pb.CreateSandboxesRequest(requests=reqs[i:i + MAX_CREATES_PER_CALL], project=project)
            for i in range(0, len(reqs), MAX_CREATES_PER_CALL)]


def _create_result(result: pb.CreateSandboxResult):
    """A CreateMany result: its SandboxInfo, or the DsecError a lone create would raise."""
    if result.code == 0 and result.HasField("sandbox"):
        return SandboxInfo._from(result.sandbox)
    code = _CODES.get(result.code, grpc.StatusCode.UNKNOWN)
    return _ERRORS.get(code, DsecError)(code, result.message)


def _timeout_ms(timeout: Optional[float]) -> int:
    """Seconds -> the API's milliseconds; a negative timeout is refused here, before the call
    (the field is unsigned: it would fail while the request is encoded)."""
    if not timeout:
        return 0
    if timeout < 0:
        raise InvalidArgument(grpc.StatusCode.INVALID_ARGUMENT,
                              f"timeout must be >= 0 seconds (None or 0 for none), got {timeout}")
    return int(timeout * 1000)


def _exec_start(sandbox_id: str, command: Command, env, workdir, timeout, stdin: bool,
                pty: Optional[Pty]) -> pb.ExecStart:
    return pb.ExecStart(sandbox_id=sandbox_id, argv=_argv(command), env=dict(env or {}),
                        workdir=workdir or "",
                        timeout_ms=_timeout_ms(timeout),
                        stdin=stdin, pty=pty._pb() if pty is not None else None)


def _exec_requests(sandbox_id: str, command: Command, env, workdir, timeout,
                   stdin: Optional[bytes], pty: Optional[Pty] = None) -> Iterator[pb.ExecRequest]:
    # Built now, not in the generator: bad arguments raise here instead of inside gRPC's
    # request iteration (which reports only "Exception iterating requests").
    start = _exec_start(sandbox_id, command, env, workdir, timeout, stdin is not None, pty)
    return _exec_stream_requests(start, stdin)


def _exec_stream_requests(start: pb.ExecStart,
                          stdin: Optional[bytes]) -> Iterator[pb.ExecRequest]:
    yield pb.ExecRequest(start=start)
    if stdin is not None:
        for i in range(0, len(stdin), _CHUNK):
            yield pb.ExecRequest(stdin=stdin[i:i + _CHUNK])
        yield pb.ExecRequest(stdin_eof=pb.StdinEof())


def _write_requests(sandbox_id: str, path: Path, data: Union[bytes, Iterable[bytes]], mode: int,
                    create_parents: bool) -> Iterator[pb.WriteFileRequest]:
    yield pb.WriteFileRequest(header=pb.WriteFileHeader(
        sandbox_id=sandbox_id, path=_path(path), mode=mode, create_parents=create_parents))
    chunks = [data] if isinstance(data, (bytes, bytearray, memoryview)) else data
    for chunk in chunks:
        chunk = bytes(chunk)
        for i in range(0, len(chunk), _CHUNK):
            yield pb.WriteFileRequest(data=chunk[i:i + _CHUNK])


def _local_reader(src) -> Tuple[Iterator[bytes], Optional[int], "Optional[object]"]:
    """Chunks of ``src`` (a local path or a binary file object with ``read``), the local
    file's permission bits when ``src`` is a path, and the file to close afterwards."""
    if isinstance(src, (str, bytes, os.PathLike)):
        f = open(src, "rb")
        mode: Optional[int] = os.fstat(f.fileno()).st_mode & 0o7777
    else:
        f, mode = src, None

    def chunks() -> Iterator[bytes]:
        while True:
            chunk = f.read(_FILE_CHUNK)
            if not chunk:
                return
            yield chunk

    return chunks(), mode, (f if f is not src else None)


def _local_writer(dst):
    """A binary file object for ``dst`` (a local path, created or truncated, or a file object
    with ``write``) and the file to close afterwards."""
    if isinstance(dst, (str, bytes, os.PathLike)):
        f = open(dst, "wb")
        return f, f
    return dst, None


class _Collector:
    def __init__(self, output_limit: Optional[int]):
        self.out: List[bytes] = []
        self.err: List[bytes] = []
        self.sizes = [0, 0]
        self.limit = output_limit
        self.exit: Optional[pb.ExitStatus] = None

    def add(self, r: pb.ExecResponse) -> None:
        kind = r.WhichOneof("kind")
        if kind in ("stdout", "stderr"):
            self.data(kind, getattr(r, kind))
        elif kind == "exit":
            self.exit = r.exit

    def data(self, kind: str, data: bytes) -> None:
        i = 0 if kind == "stdout" else 1
        if self.limit is not None:
            data = data[:max(0, self.limit - self.sizes[i])]
        self.sizes[i] += len(data)
        (self.out if i == 0 else self.err).append(data)

    def result(self) -> ExecResult:
        if self.exit is None:
            raise DsecError(grpc.StatusCode.INTERNAL, "exec stream ended without an exit status")
        e = self.exit
        return ExecResult(b"".join(self.out), b"".join(self.err),
                          e.code if e.HasField("code") else None,
                          e.signal if e.HasField("signal") else None, e.timed_out)


class _StreamState:
    """What an exec stream has seen besides output: the exit status, or the call's error.
    Output is handed to the iterating caller and not kept."""

    def __init__(self):
        self.exit: Optional[pb.ExitStatus] = None
        self.error: Optional[DsecError] = None
        self.done = False

    def event(self, r: pb.ExecResponse) -> Optional[ExecEvent]:
        kind = r.WhichOneof("kind")
        if kind in ("stdout", "stderr"):
            return kind, getattr(r, kind)
        if kind == "exit":
            self.exit = r.exit
        return None

    def failed(self, e: grpc.RpcError) -> DsecError:
        self.done = True
        self.error = _error(e)
        return self.error

    def result(self, collector: _Collector) -> ExecResult:
        if self.error is not None:
            raise self.error
        collector.exit = self.exit
        return collector.result()


class ExecStream:
    """A running command (:meth:`Sandbox.exec_stream`): write its stdin, send signals and
    terminal resizes, iterate its output as ``(stream, data)`` events, then :meth:`wait`.
    Call errors (e.g. :class:`InvalidArgument` for a bad resize) are raised while iterating
    (and again by later iterations and :meth:`wait`).

    Iterating keeps nothing: each chunk is only handed to the caller, so memory stays
    bounded however much the command writes. :meth:`wait` returns the exit status and the
    output not iterated yet; it may follow a full or partial iteration."""

    def __init__(self, process: rpc.ProcessStub, start: pb.ExecStart):
        self._requests: "queue.Queue[Optional[pb.ExecRequest]]" = queue.Queue()
        self._requests.put(pb.ExecRequest(start=start))
        self._closed = False
        self._call = process.Exec(iter(self._requests.get, None))
        self._state = _StreamState()

    def _send(self, request: pb.ExecRequest) -> None:
        if self._closed:
            raise DsecError(grpc.StatusCode.FAILED_PRECONDITION,
                            "the command's input is closed (the call ended): read its result")
        self._requests.put(request)

    def write(self, data: bytes) -> None:
        """Bytes for stdin (needs ``stdin=True``); on a PTY b"\\x03" is Ctrl-C."""
        self._send(pb.ExecRequest(stdin=bytes(data)))

    def close_stdin(self) -> None:
        """Ends stdin (on a PTY: sends the EOF character, ^D)."""
        self._send(pb.ExecRequest(stdin_eof=pb.StdinEof()))

    def signal(self, signum: int) -> None:
        """Sends a signal to the command's process group."""
        self._send(pb.ExecRequest(signal=int(signum)))

    def resize(self, rows: int, cols: int) -> None:
        """New terminal size (PTY only; the command gets SIGWINCH). Sizes outside 1..4096
        end the call: :class:`InvalidArgument` comes from the output side."""
        self._send(pb.ExecRequest(resize=pb.WindowSize(rows=rows, cols=cols)))

    def __iter__(self) -> Iterator[ExecEvent]:
        # Stopping early (break, read_until) leaves the call running: only its end finishes.
        state = self._state
        while not state.done:
            try:
                r = next(self._call)
            except StopIteration:
                state.done = True
                self._finish()
                break
            except grpc.RpcError as e:
                self._finish()
                raise state.failed(e) from None
            event = state.event(r)
            if event is not None:
                yield event
        if state.error is not None:
            raise state.error

    def read_until(self, needle: bytes, timeout: float = 30.0) -> bytes:
        """Output (both streams) up to and including the chunk holding the first
        ``needle``. Raises :class:`DsecError` (DEADLINE_EXCEEDED) when the command ends first
        or after ``timeout`` seconds (which cancel the call and so kill the command)."""
        import threading
        seen = bytearray()
        timer = threading.Timer(timeout, self._call.cancel)
        timer.start()
        try:
            for _, data in self:
                seen += data
                if needle in seen:
                    return bytes(seen)
        except DsecError as e:
            if e.code != grpc.StatusCode.CANCELLED:
                raise
        finally:
            timer.cancel()
        raise DsecError(grpc.StatusCode.DEADLINE_EXCEEDED,
                        f"{needle!r} did not appear in the output: got {bytes(seen)!r}")

    def wait(self, output_limit: Optional[int] = None) -> ExecResult:
        """Reads to the end and returns the exit status with the output not iterated yet
        (empty after a full iteration; at most ``output_limit`` bytes of each stream are
        kept, the rest is read and dropped). Raises the call's error, if it failed."""
        collector = _Collector(output_limit)
        for kind, data in self:
            collector.data(kind, data)
        return self._state.result(collector)

    def cancel(self) -> None:
        """Ends the call; the node kills the command."""
        self._call.cancel()
        self._finish()

    def _finish(self) -> None:
        if not self._closed:
            self._closed = True
            self._requests.put(None)


class AsyncExecStream:
    """The asyncio twin of :class:`ExecStream` (:meth:`AsyncSandbox.exec_stream`): iterating
    keeps nothing, :meth:`wait` works after a full or partial iteration."""

    def __init__(self, process: rpc.ProcessStub, start: pb.ExecStart):
        self._requests: "asyncio.Queue[Optional[pb.ExecRequest]]" = asyncio.Queue()
        self._requests.put_nowait(pb.ExecRequest(start=start))
        self._closed = False

        async def requests():
            while (r := await self._requests.get()) is not None:
                yield r

        self._call = process.Exec(requests())
        self._state = _StreamState()

    def _send(self, request: pb.ExecRequest) -> None:
        if self._closed:
            raise DsecError(grpc.StatusCode.FAILED_PRECONDITION,
                            "the command's input is closed (the call ended): read its result")
        self._requests.put_nowait(request)

    async def write(self, data: bytes) -> None:
        self._send(pb.ExecRequest(stdin=bytes(data)))

    async def close_stdin(self) -> None:
        self._send(pb.ExecRequest(stdin_eof=pb.StdinEof()))

    async def signal(self, signum: int) -> None:
        self._send(pb.ExecRequest(signal=int(signum)))

    async def resize(self, rows: int, cols: int) -> None:
        self._send(pb.ExecRequest(resize=pb.WindowSize(rows=rows, cols=cols)))

    async def __aiter__(self) -> AsyncIterator[ExecEvent]:
        state = self._state
        while not state.done:
            try:
                r = await self._call.read()
            except grpc.RpcError as e:
                self._finish()
                raise state.failed(e) from None
            if r is grpc.aio.EOF:
                state.done = True
                self._finish()
                break
            event = state.event(r)
            if event is not None:
                yield event
        if state.error is not None:
            raise state.error

    async def read_until(self, needle: bytes, timeout: float = 30.0) -> bytes:
        """As :meth:`ExecStream.read_until`."""
        seen = bytearray()

        async def scan() -> bool:
            nonlocal seen
            async for _, data in self:
                seen += data
                if needle in seen:
                    return True
            return False

        try:
            found = await asyncio.wait_for(scan(), timeout)
        except asyncio.TimeoutError:
            found = False
        if not found:
            raise DsecError(grpc.StatusCode.DEADLINE_EXCEEDED,
                            f"{needle!r} did not appear in the output: got {bytes(seen)!r}")
        return bytes(seen)

    async def wait(self, output_limit: Optional[int] = None) -> ExecResult:
        """As :meth:`ExecStream.wait`: the exit status and the output not iterated yet."""
        collector = _Collector(output_limit)
        async for kind, data in self:
            collector.data(kind, data)
        return self._state.result(collector)

    def cancel(self) -> None:
        self._call.cancel()
        self._finish()

    def _finish(self) -> None:
        if not self._closed:
            self._closed = True
            self._requests.put_nowait(None)


def _channel_options():
    # gRPC derives the HTTP/2 :authority of a unix: target from the socket path, which the
    # server's HTTP/2 stack rejects as malformed; any fixed host name will do. Round robin
    # spreads calls over several addresses and skips those that are down.
    return [("grpc.max_receive_message_length", _MAX_MESSAGE),
            ("grpc.max_send_message_length", _MAX_MESSAGE),
            ("grpc.default_authority", "localhost"),
            ("grpc.lb_policy_name", "round_robin")]


def _open_channel(target: str, ca_file: Optional[str], aio: bool):
    """An insecure channel, or for ``https://`` targets (an apiserver with the cluster's TLS)
    a TLS channel that checks the server against the cluster CA in ``ca_file`` (default
    ``$DSEC_CA_FILE``) and the host of the first address."""
    grpc_mod = grpc.aio if aio else grpc
    parts = [t.strip() for t in target.split(",") if t.strip()]
    if not any(p.startswith("https://") for p in parts):
        return grpc_mod.insecure_channel(_grpc_target(target), options=_channel_options())
    ca_file = ca_file or os.environ.get("DSEC_CA_FILE", "")
    if not ca_file:
        raise DsecError(grpc.StatusCode.INVALID_ARGUMENT,
                        f"{target}: an https:// target needs the cluster CA: pass ca_file= "
                        "or set DSEC_CA_FILE to the ca.pem of `dsec control init`")
    try:
        with open(ca_file, "rb") as f:
            roots = f.read()
    except OSError as e:
        raise DsecError(grpc.StatusCode.INVALID_ARGUMENT,
                        f"cannot read the cluster CA {ca_file}: {e}") from e
    first = parts[0].split("://", 1)[-1]
    host = first[1:first.index("]")] if first.startswith("[") else first.rsplit(":", 1)[0]
    options = [o for o in _channel_options() if o[0] != "grpc.default_authority"]
    options += [("grpc.ssl_target_name_override", host), ("grpc.default_authority", host)]
    credentials = grpc.ssl_channel_credentials(root_certificates=roots)
    return grpc_mod.secure_channel(_grpc_target(target), credentials, options=options)


# ---------------------------------------------------------------- sync API


class Client:
    """Synchronous client. ``Client()`` talks to the local node on its default socket."""

    def __init__(self, target: Optional[str] = None, *, token: Optional[str] = None,
                 project: Optional[str] = None, ca_file: Optional[str] = None):
        """``target``: ``unix:PATH``, ``HOST:PORT`` or several ``HOST:PORT`` (apiserver
        replicas) separated by commas, ``https://HOST:PORT`` for an apiserver with TLS;
        default ``$DSEC_ENDPOINT`` or the local node. ``token`` and ``project`` (default
        ``$DSEC_TOKEN``, ``$DSEC_PROJECT``) are what an apiserver needs; ``ca_file`` (default
        ``$DSEC_CA_FILE``) the cluster CA an https:// apiserver is checked against."""
        self.target = target or default_target()
        self.project, metadata = _credentials(token, project)
        self._channel = _open_channel(self.target, ca_file, aio=False)
        channel = _CredentialChannel(self._channel, metadata)
        self._sandboxes = rpc.SandboxesStub(channel)
        self._process = rpc.ProcessStub(channel)
        self._files = rpc.FilesStub(channel)
        self._sessions = rpc.SessionsStub(channel)
        self._ports = rpc.PortsStub(channel)
        self._network = rpc.NetworkStub(channel)
        self._network_labels = rpc.NetworkLabelsStub(channel)
        self._fn = rpc.FnStub(channel)

    def _call(self, fn, request):
        try:
            return fn(request)
        except grpc.RpcError as e:
            raise _error(e) from None

    def create(self, *, backend: str = "", image: str = "", vcpus: int = 0, memory_mib: int = 0,
               disk_mib: int = 0, env: Optional[Mapping[str, str]] = None, ttl: int = 0,
               idle_timeout: int = 0, labels: Optional[Mapping[str, str]] = None,
               pids_limit: int = 0, allow_internet: bool = False,
               request_id: Optional[str] = None,
               public_ports: Iterable[int] = ()) -> "Sandbox":
        """Creates a sandbox; returns when it is ready. 0 / "" mean node defaults.
        ``request_id`` (default: a fresh random one) makes the call idempotent: a Create
        repeating it returns the sandbox the first one made; retries reuse it.
        ``public_ports`` are served to everyone without the access token."""
        req = _create_request(backend, image, vcpus, memory_mib, disk_mib, env, ttl,
                              idle_timeout, labels, pids_limit, allow_internet, request_id,
                              public_ports)
        return self._create(req)

    def restore(self, snapshot: str, *, env: Optional[Mapping[str, str]] = None, ttl: int = 0,
                idle_timeout: int = 0, labels: Optional[Mapping[str, str]] = None,
                request_id: Optional[str] = None,
                public_ports: Iterable[int] = ()) -> "Sandbox":
        """A new sandbox restored from ``snapshot``, the path :meth:`Sandbox.snapshot`
        returned on this node: the snapshot's image, shape, files and processes, with its own
        id, entropy and the host's clock. The snapshot is kept."""
        req = _create_request("", "", 0, 0, 0, env, ttl, idle_timeout, labels, 0, False,
                              request_id, public_ports)
        req.from_snapshot = snapshot
        return self._create(req)

    def create_many(self, specs: Iterable[Mapping[str, Any]]) -> List[Union["Sandbox", DsecError]]:
        """Many sandboxes in few calls (CreateMany, up to 256 per call): ``specs`` holds
        :meth:`create`'s keyword arguments per sandbox. One entry per spec, in order: the
        Sandbox, or the DsecError that sandbox's create would have raised (e.g.
        ResourceExhausted naming the project over quota); the others are not affected."""
        out: List[Union["Sandbox", DsecError]] = []
        for call in _create_many_requests(specs, self.project):
            for attempt in range(1, CREATE_ATTEMPTS + 1):
                try:
                    answer = self._call(self._sandboxes.CreateMany, call)
                    break
                except Unavailable:
                    if attempt == CREATE_ATTEMPTS:
                        raise
                    time.sleep(0.2 * 2 ** attempt)
            for result in answer.results:
                r = _create_result(result)
                out.append(r if isinstance(r, DsecError) else Sandbox(self, r))
        return out

    def _create(self, req: pb.CreateSandboxRequest) -> "Sandbox":
        req.project = self.project
        for attempt in range(1, CREATE_ATTEMPTS + 1):
            try:
                s = self._call(self._sandboxes.Create, req)
                return Sandbox(self, SandboxInfo._from(s))
            except Unavailable:
                if attempt == CREATE_ATTEMPTS:
                    raise
                time.sleep(0.2 * 2 ** attempt)
        raise AssertionError("unreachable")

    def get(self, sandbox_id: str) -> "Sandbox":
        s = self._call(self._sandboxes.Get, pb.GetSandboxRequest(sandbox_id=sandbox_id))
        return Sandbox(self, SandboxInfo._from(s))

    def set_network_policy_by_labels(self, labels: Mapping[str, str],
                                     allow: Iterable[str] = (), deny: Iterable[str] = (),
                                     allow_internet: bool = False) -> List["Sandbox"]:
        """Replaces the network policy of every sandbox carrying all of ``labels`` (at least
        one): one SetNetworkPolicyByLabels (the node picks the sandboxes and checks the policy
        once); where that is unimplemented (an apiserver not routing it yet), a List and one
        SetNetworkPolicy per sandbox. Sandboxes deleted meanwhile are skipped; ones created
        meanwhile are not covered. Returns the sandboxes changed; a sandbox that could not
        take the policy raises FailedPrecondition naming it."""
        if not labels:
            raise ValueError("set_network_policy_by_labels needs at least one label")
        policy = _network_policy(allow, deny, allow_internet)
        try:
            r = self._call(self._network_labels.SetNetworkPolicyByLabels,
                           pb.SetNetworkPolicyByLabelsRequest(labels=dict(labels),
                                                              network=policy))
        except Unimplemented:
            r = None
        if r is not None:
            if r.failed:
                raise FailedPrecondition(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"{len(r.failed)} of the labelled sandboxes could not take the policy (the "
                    f"others did), first {r.failed[0].sandbox_id}: {r.failed[0].message}")
            return [Sandbox(self, SandboxInfo._from(s)) for s in r.sandboxes]
        changed: List[Sandbox] = []
        for sb in self.list(labels):
            try:
                sb.set_network_policy(list(policy.allow), list(policy.deny),
                                      policy.allow_internet)
            except NotFound:
                continue
            changed.append(sb)
        return changed

    def list(self, labels: Optional[Mapping[str, str]] = None, *,
             page_size: int = 0) -> List["Sandbox"]:
        """Every sandbox carrying all of ``labels``, in the order of their ids: pages through
        the node's List (``page_size`` per call; 0 means the node's default of 500)."""
        out: List[Sandbox] = []
        token = ""
        while True:
            r = self._call(self._sandboxes.List, pb.ListSandboxesRequest(
                labels=dict(labels or {}), page_size=page_size, page_token=token,
                project=self.project))
            out += [Sandbox(self, SandboxInfo._from(s)) for s in r.sandboxes]
            if not r.next_page_token or r.next_page_token == token:
                return out
            token = r.next_page_token

    def run_code(self, code: str, language: str = "python", *, stdin=b"",
                 files: Optional[Mapping[str, bytes]] = None, fetch_files: Iterable[str] = (),
                 compile_timeout: float = 10, run_timeout: float = 10, memory_mib: int = 0,
                 network: bool = False, image: str = "",
                 network_policy: Optional[Mapping] = None) -> CodeResult:
        """Runs ``code`` once in a warm FnCall worker of the node (``Fn.Run``): a fresh,
        isolated process; ``language`` is python, bash, cpp or node. ``files`` are written
        to its working directory first, ``fetch_files`` read back after. ``network_policy``
        (``{"allow": [...], "deny": [...], "allow_internet": bool}``: rules, domain rules
        and node policy names) runs it on the node's sandbox network reaching just that;
        ``network=True`` alone reaches nothing."""
        req = _run_code_request(code, language, stdin, files, fetch_files, compile_timeout,
                                run_timeout, memory_mib, network, image, network_policy)
        return CodeResult._from(self._call(self._fn.Run, req))

    def node_status(self) -> pb.NodeStatusResponse:
        return self._call(self._sandboxes.NodeStatus, pb.NodeStatusRequest())

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Sandbox:
    """A sandbox on a node. ``with client.create() as sb:`` deletes it at the end."""

    def __init__(self, client: Client, info: SandboxInfo):
        self.client = client
        self.info = info
        self.id = info.id

    def __repr__(self) -> str:
        return f"Sandbox({self.id!r}, {self.info.backend}, {self.info.state})"

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.delete()
        except NotFound:
            pass

    def _call(self, fn, request):
        return self.client._call(fn, request)

    def refresh(self) -> SandboxInfo:
        self.info = self.client.get(self.id).info
        return self.info

    def exec(self, command: Command, *, env: Optional[Mapping[str, str]] = None,
             workdir: Optional[str] = None, timeout: Optional[float] = None,
             stdin: Optional[bytes] = None, output_limit: Optional[int] = None,
             pty: Optional[Pty] = None) -> ExecResult:
        """Runs a command (a string runs through /bin/sh -c) and collects its output
        (at most ``output_limit`` bytes of each stream are kept). With ``pty`` it runs on a
        pseudo-terminal and all output is stdout."""
        c = _Collector(output_limit)
        try:
            for r in self.client._process.Exec(
                    _exec_requests(self.id, command, env, workdir, timeout, stdin, pty)):
                c.add(r)
        except grpc.RpcError as e:
            raise _error(e) from None
        return c.result()

    def exec_stream(self, command: Command, *, env: Optional[Mapping[str, str]] = None,
                    workdir: Optional[str] = None, timeout: Optional[float] = None,
                    stdin: bool = False, pty: Optional[Pty] = None) -> ExecStream:
        """Starts a command and returns at once: drive it live through the
        :class:`ExecStream` (stdin with ``stdin=True``, resizes with ``pty``)."""
        return ExecStream(self.client._process,
                          _exec_start(self.id, command, env, workdir, timeout, stdin, pty))

    def read_file(self, path: Path) -> bytes:
        try:
            return b"".join(c.data for c in self.client._files.Read(
                pb.ReadFileRequest(sandbox_id=self.id, path=_path(path))))
        except grpc.RpcError as e:
            raise _error(e) from None

    def write_file(self, path: Path, data: Union[bytes, Iterable[bytes]], *, mode: int = 0,
                   create_parents: bool = False) -> int:
        """Creates or truncates ``path``; ``data`` may be bytes or an iterable of chunks."""
        try:
            r = self.client._files.Write(
                _write_requests(self.id, path, data, mode, create_parents))
        except grpc.RpcError as e:
            raise _error(e) from None
        return r.bytes_written

    def read_file_to(self, path: Path, dst) -> int:
        """Streams a sandbox file into ``dst``: a local path (created or truncated) or a
        binary file object with ``write``. Chunks are written as they arrive, so memory stays
        bounded whatever the size; returns the number of bytes."""
        f, owned = _local_writer(dst)
        total = 0
        try:
            for c in self.client._files.Read(pb.ReadFileRequest(sandbox_id=self.id,
                                                                path=_path(path))):
                f.write(c.data)
                total += len(c.data)
        except grpc.RpcError as e:
            raise _error(e) from None
        finally:
            if owned is not None:
                owned.close()
        return total

    def write_file_from(self, path: Path, src, *, mode: Optional[int] = None,
                        create_parents: bool = False) -> int:
        """Streams ``src`` (a local path, or a binary file object with ``read``) into the
        sandbox file ``path`` (created or truncated) in 256 KiB chunks as the node takes them.
        ``mode`` None: the local file's permission bits for a path, else 0644; applied when
        the file is created, less the agent's umask. Returns the number of bytes."""
        chunks, local_mode, owned = _local_reader(src)
        if mode is None:
            mode = local_mode or 0
        try:
            return self.write_file(path, chunks, mode=mode, create_parents=create_parents)
        finally:
            if owned is not None:
                owned.close()

    def list_dir(self, path: Path) -> List[FileInfo]:
        r = self._call(self.client._files.List, pb.ListDirRequest(sandbox_id=self.id, path=_path(path)))
        return [FileInfo._from(f) for f in r.entries]

    def stat(self, path: Path) -> FileInfo:
        return FileInfo._from(self._call(self.client._files.Stat,
                                         pb.StatRequest(sandbox_id=self.id, path=_path(path))))

    def mkdir(self, path: Path, *, parents: bool = False, mode: int = 0) -> None:
        self._call(self.client._files.Mkdir,
                   pb.MkdirRequest(sandbox_id=self.id, path=_path(path), parents=parents, mode=mode))

    def remove(self, path: Path, *, recursive: bool = False) -> None:
        self._call(self.client._files.Remove,
                   pb.RemoveRequest(sandbox_id=self.id, path=_path(path), recursive=recursive))

    def rename(self, src: Path, dst: Path) -> None:
        self._call(self.client._files.Rename,
                   pb.RenameRequest(sandbox_id=self.id, **{"from": _path(src)}, to=_path(dst)))

    def session(self, *, shell: str = "", env: Optional[Mapping[str, str]] = None,
                workdir: str = "") -> "Session":
        """Opens a persistent shell session (cwd, env and shell state persist)."""
        info = self._call(self.client._sessions.Create, pb.CreateSessionRequest(
            sandbox_id=self.id, shell=shell, env=dict(env or {}), workdir=workdir))
        return Session(self, info.session_id)

    def open_port(self, port: int) -> PortStream:
        """A TCP connection to 127.0.0.1:``port`` inside the sandbox. Raises
        :class:`Unavailable` when nothing listens there, :class:`InvalidArgument` for a port
        outside 1-65535, :class:`FailedPrecondition` when the sandbox is paused."""
        if not self.info.access_token and not self.client.target.startswith("unix:"):
            self.refresh()  # over TCP a private port needs the token (List omits it)
        return PortStream(self.id, port, self.client._ports, self.info.access_token)

    def port_url(self, port: int) -> PortUrl:
        """Where the node's HTTP entry point serves ``port``; :class:`FailedPrecondition`
        when the node runs without one."""
        _check_port(port)
        r = self._call(self.client._ports.Url, pb.PortUrlRequest(sandbox_id=self.id, port=port))
        return PortUrl(r.url, r.host, r.address, r.access_token)

    def url(self, port: int) -> str:
        """``http://PORT-ID-TOKEN.localhost:7080/``: fetch it with any HTTP client on the
        node (the token is in the host name; none for a public port)."""
        return self.port_url(port).url

    def set_port_public(self, port: int, public: bool = True) -> List[int]:
        """Opens ``port`` to everyone through the HTTP entry point (no token needed), or
        with ``public=False`` makes it private again; returns the public ports."""
        _check_port(port)
        r = self._call(self.client._ports.SetPublic,
                       pb.SetPortPublicRequest(sandbox_id=self.id, port=port, public=public))
        return list(r.public_ports)

    def set_network_policy(self, allow: Iterable[str] = (), deny: Iterable[str] = (),
                           allow_internet: bool = False) -> SandboxInfo:
        """Replaces the sandbox's network policy (rules ``[tcp:|udp:|icmp:]CIDR[:PORT[-PORT]]``
        and names of the node's policies; nothing = it reaches nothing). New connections
        follow it at once; open connections it denies are cut."""
        self.info = SandboxInfo._from(self._call(
            self.client._network.SetNetworkPolicy,
            pb.SetNetworkPolicyRequest(sandbox_id=self.id,
                                       network=_network_policy(allow, deny, allow_internet))))
        return self.info

    def pause(self) -> SandboxInfo:
        self.info = SandboxInfo._from(self._call(self.client._sandboxes.Pause,
                                                 pb.PauseSandboxRequest(sandbox_id=self.id)))
        return self.info

    def resume(self) -> SandboxInfo:
        self.info = SandboxInfo._from(self._call(self.client._sandboxes.Resume,
                                                 pb.ResumeSandboxRequest(sandbox_id=self.id)))
        return self.info

    def set_timeout(self, ttl: int, idle_timeout: Optional[int] = None) -> SandboxInfo:
        req = pb.SetTimeoutRequest(sandbox_id=self.id, ttl_seconds=ttl)
        if idle_timeout is not None:
            req.idle_timeout_seconds = idle_timeout
        self.info = SandboxInfo._from(self._call(self.client._sandboxes.SetTimeout, req))
        return self.info

    def fork(self, count: int = 1, labels: Optional[Mapping[str, str]] = None) -> List["Sandbox"]:
        r = self._call(self.client._sandboxes.Fork, pb.ForkSandboxRequest(
            sandbox_id=self.id, count=count, labels=dict(labels or {})))
        return [Sandbox(self.client, SandboxInfo._from(s)) for s in r.sandboxes]

    def snapshot(self, path: str = "", diff: bool = False) -> str:
        return self._call(self.client._sandboxes.Snapshot, pb.SnapshotSandboxRequest(
            sandbox_id=self.id, path=path, diff=diff)).path

    def logs(self) -> Dict[str, bytes]:
        out: Dict[str, bytes] = {}
        try:
            for c in self.client._sandboxes.Logs(pb.LogsRequest(sandbox_id=self.id)):
                out[c.source] = out.get(c.source, b"") + c.data
        except grpc.RpcError as e:
            raise _error(e) from None
        return out

    def delete(self) -> None:
        self._call(self.client._sandboxes.Delete, pb.DeleteSandboxRequest(sandbox_id=self.id))


class PortStream:
    """A TCP connection to a port inside a sandbox (:meth:`Sandbox.open_port`).

    ``send`` writes to the server, ``close_write`` half-closes (the server reads EOF),
    ``recv`` returns what the server sends (``b""`` once it closed its side). Use it as a
    context manager, or call ``close`` to drop the connection."""

    _END = object()

    def __init__(self, sandbox_id: str, port: int, stub: rpc.PortsStub, token: str = ""):
        self._requests: "queue.Queue" = queue.Queue()
        self._requests.put(_port_open(sandbox_id, port, token))
        self._write_closed = False
        self._read_closed = False
        self._call = stub.Open(iter(self._requests.get, self._END))
        try:
            first = next(self._call)
        except grpc.RpcError as e:
            self._requests.put(self._END)
            raise _error(e) from None
        except StopIteration:
            raise Unavailable(grpc.StatusCode.UNAVAILABLE,
                              "the port stream ended before the connection was made") from None
        if first.WhichOneof("kind") != "connected":
            self.close()
            raise DsecError(grpc.StatusCode.INTERNAL, "the node did not confirm the connection")

    def send(self, data: bytes) -> None:
        if self._write_closed:
            raise FailedPrecondition(grpc.StatusCode.FAILED_PRECONDITION,
                                     "send after close_write: the write side is closed")
        for m in _port_data(data):
            self._requests.put(m)

    def close_write(self) -> None:
        if not self._write_closed:
            self._write_closed = True
            self._requests.put(_PORT_EOF)
            self._requests.put(self._END)

    def recv(self) -> bytes:
        """The next bytes from the server; ``b""`` once it has closed its side."""
        while not self._read_closed:
            try:
                r = next(self._call)
            except StopIteration:
                self._read_closed = True
                break
            except grpc.RpcError as e:
                raise _error(e) from None
            kind = r.WhichOneof("kind")
            if kind == "data":
                return r.data
            if kind == "eof":
                self._read_closed = True
        return b""

    def read_all(self) -> bytes:
        """Everything the server sends until it closes its side."""
        parts = []
        while True:
            data = self.recv()
            if not data:
                return b"".join(parts)
            parts.append(data)

    def close(self) -> None:
        """Drops the connection (both directions) at once."""
        self._call.cancel()
        if not self._write_closed:
            self._write_closed = True
            self._requests.put(self._END)

    def __enter__(self) -> "PortStream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Session:
    """A persistent shell in a sandbox (Chronus)."""

    def __init__(self, sandbox: Sandbox, session_id: str):
        self.sandbox = sandbox
        self.id = session_id

    def run(self, command: str, *, timeout: Optional[float] = None, wait: bool = True,
            output_limit: int = 0) -> CommandResult:
        r = self.sandbox._call(self.sandbox.client._sessions.Run, pb.RunInSessionRequest(
            sandbox_id=self.sandbox.id, session_id=self.id, command=command,
            timeout_ms=_timeout_ms(timeout), wait=wait,
            output_limit=output_limit))
        return CommandResult._from(r)

    def read_output(self, command_id: int = 0, *, wait: bool = False) -> CommandResult:
        r = self.sandbox._call(self.sandbox.client._sessions.ReadOutput, pb.ReadOutputRequest(
            sandbox_id=self.sandbox.id, session_id=self.id, command_id=command_id, wait=wait))
        return CommandResult._from(r)

    def close(self) -> None:
        self.sandbox._call(self.sandbox.client._sessions.Close, pb.CloseSessionRequest(
            sandbox_id=self.sandbox.id, session_id=self.id))


# ---------------------------------------------------------------- async API


class AsyncClient:
    """asyncio client (grpc.aio); same calls as :class:`Client`, awaited."""

    def __init__(self, target: Optional[str] = None, *, token: Optional[str] = None,
                 project: Optional[str] = None, ca_file: Optional[str] = None):
        """``target``: ``unix:PATH``, ``HOST:PORT`` or several ``HOST:PORT`` (apiserver
        replicas) separated by commas, ``https://HOST:PORT`` for an apiserver with TLS;
        default ``$DSEC_ENDPOINT`` or the local node. ``token`` and ``project`` (default
        ``$DSEC_TOKEN``, ``$DSEC_PROJECT``) are what an apiserver needs; ``ca_file`` (default
        ``$DSEC_CA_FILE``) the cluster CA an https:// apiserver is checked against."""
        self.target = target or default_target()
        self.project, metadata = _credentials(token, project)
        self._channel = _open_channel(self.target, ca_file, aio=True)
        channel = _CredentialChannel(self._channel, metadata)
        self._sandboxes = rpc.SandboxesStub(channel)
        self._process = rpc.ProcessStub(channel)
        self._files = rpc.FilesStub(channel)
        self._sessions = rpc.SessionsStub(channel)
        self._ports = rpc.PortsStub(channel)
        self._network = rpc.NetworkStub(channel)
        self._fn = rpc.FnStub(channel)

    async def _call(self, fn, request):
        try:
            return await fn(request)
        except grpc.RpcError as e:
            raise _error(e) from None

    async def create(self, *, backend: str = "", image: str = "", vcpus: int = 0,
                     memory_mib: int = 0, disk_mib: int = 0,
                     env: Optional[Mapping[str, str]] = None, ttl: int = 0,
                     idle_timeout: int = 0, labels: Optional[Mapping[str, str]] = None,
                     pids_limit: int = 0, allow_internet: bool = False,
                     request_id: Optional[str] = None,
                     public_ports: Iterable[int] = ()) -> "AsyncSandbox":
        req = _create_request(backend, image, vcpus, memory_mib, disk_mib, env, ttl,
                              idle_timeout, labels, pids_limit, allow_internet, request_id,
                              public_ports)
        return await self._create(req)

    async def restore(self, snapshot: str, *, env: Optional[Mapping[str, str]] = None,
                      ttl: int = 0, idle_timeout: int = 0,
                      labels: Optional[Mapping[str, str]] = None,
                      request_id: Optional[str] = None,
                      public_ports: Iterable[int] = ()) -> "AsyncSandbox":
        """asyncio twin of :meth:`Client.restore`."""
        req = _create_request("", "", 0, 0, 0, env, ttl, idle_timeout, labels, 0, False,
                              request_id, public_ports)
        req.from_snapshot = snapshot
        return await self._create(req)

    async def create_many(self, specs: Iterable[Mapping[str, Any]]
                          ) -> List[Union["AsyncSandbox", DsecError]]:
        """asyncio twin of :meth:`Client.create_many`."""
        out: List[Union["AsyncSandbox", DsecError]] = []
        for call in _create_many_requests(specs, self.project):
            for attempt in range(1, CREATE_ATTEMPTS + 1):
                try:
                    answer = await self._call(self._sandboxes.CreateMany, call)
                    break
                except Unavailable:
                    if attempt == CREATE_ATTEMPTS:
                        raise
                    await asyncio.sleep(0.2 * 2 ** attempt)
            for result in answer.results:
                r = _create_result(result)
                out.append(r if isinstance(r, DsecError) else AsyncSandbox(self, r))
        return out

    async def _create(self, req: pb.CreateSandboxRequest) -> "AsyncSandbox":
        req.project = self.project
        for attempt in range(1, CREATE_ATTEMPTS + 1):
            try:
                s = await self._call(self._sandboxes.Create, req)
                return AsyncSandbox(self, SandboxInfo._from(s))
            except Unavailable:
                if attempt == CREATE_ATTEMPTS:
                    raise
                await asyncio.sleep(0.2 * 2 ** attempt)
        raise AssertionError("unreachable")

    async def run_code(self, code: str, language: str = "python", *, stdin=b"",
                       files: Optional[Mapping[str, bytes]] = None,
                       fetch_files: Iterable[str] = (), compile_timeout: float = 10,
                       run_timeout: float = 10, memory_mib: int = 0, network: bool = False,
                       image: str = "",
                       network_policy: Optional[Mapping] = None) -> CodeResult:
        """:meth:`Client.run_code`, awaited."""
        req = _run_code_request(code, language, stdin, files, fetch_files, compile_timeout,
                                run_timeout, memory_mib, network, image, network_policy)
        return CodeResult._from(await self._call(self._fn.Run, req))

    async def get(self, sandbox_id: str) -> "AsyncSandbox":
        s = await self._call(self._sandboxes.Get, pb.GetSandboxRequest(sandbox_id=sandbox_id))
        return AsyncSandbox(self, SandboxInfo._from(s))

    async def set_network_policy_by_labels(self, labels: Mapping[str, str],
                                           allow: Iterable[str] = (), deny: Iterable[str] = (),
                                           allow_internet: bool = False) -> List["AsyncSandbox"]:
        """See :meth:`Client.set_network_policy_by_labels`."""
        if not labels:
            raise ValueError("set_network_policy_by_labels needs at least one label")
        policy = _network_policy(allow, deny, allow_internet)
        changed: List[AsyncSandbox] = []
        for sb in await self.list(labels):
            try:
                await sb.set_network_policy(list(policy.allow), list(policy.deny),
                                            policy.allow_internet)
            except NotFound:
                continue
            changed.append(sb)
        return changed

    async def list(self, labels: Optional[Mapping[str, str]] = None, *,
                   page_size: int = 0) -> List["AsyncSandbox"]:
        """Every sandbox carrying all of ``labels``, paging through the node's List."""
        out: List[AsyncSandbox] = []
        token = ""
        while True:
            r = await self._call(self._sandboxes.List, pb.ListSandboxesRequest(
                labels=dict(labels or {}), page_size=page_size, page_token=token,
                project=self.project))
            out += [AsyncSandbox(self, SandboxInfo._from(s)) for s in r.sandboxes]
            if not r.next_page_token or r.next_page_token == token:
                return out
            token = r.next_page_token

    async def node_status(self) -> pb.NodeStatusResponse:
        return await self._call(self._sandboxes.NodeStatus, pb.NodeStatusRequest())

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


class AsyncSandbox:
    def __init__(self, client: AsyncClient, info: SandboxInfo):
        self.client = client
        self.info = info
        self.id = info.id

    def __repr__(self) -> str:
        return f"AsyncSandbox({self.id!r}, {self.info.backend}, {self.info.state})"

    async def __aenter__(self) -> "AsyncSandbox":
        return self

    async def __aexit__(self, *exc) -> None:
        try:
            await self.delete()
        except NotFound:
            pass

    async def exec(self, command: Command, *, env: Optional[Mapping[str, str]] = None,
                   workdir: Optional[str] = None, timeout: Optional[float] = None,
                   stdin: Optional[bytes] = None,
                   output_limit: Optional[int] = None,
                   pty: Optional[Pty] = None) -> ExecResult:
        c = _Collector(output_limit)
        try:
            call = self.client._process.Exec(
                _exec_requests(self.id, command, env, workdir, timeout, stdin, pty))
            async for r in call:
                c.add(r)
        except grpc.RpcError as e:
            raise _error(e) from None
        return c.result()

    def exec_stream(self, command: Command, *, env: Optional[Mapping[str, str]] = None,
                    workdir: Optional[str] = None, timeout: Optional[float] = None,
                    stdin: bool = False, pty: Optional[Pty] = None) -> AsyncExecStream:
        """As :meth:`Sandbox.exec_stream` (call it inside the running event loop)."""
        return AsyncExecStream(self.client._process,
                               _exec_start(self.id, command, env, workdir, timeout, stdin, pty))

    async def read_file(self, path: Path) -> bytes:
        parts = []
        try:
            async for c in self.client._files.Read(
                    pb.ReadFileRequest(sandbox_id=self.id, path=_path(path))):
                parts.append(c.data)
        except grpc.RpcError as e:
            raise _error(e) from None
        return b"".join(parts)

    async def write_file(self, path: Path, data: Union[bytes, Iterable[bytes]], *, mode: int = 0,
                         create_parents: bool = False) -> int:
        try:
            r = await self.client._files.Write(
                _write_requests(self.id, path, data, mode, create_parents))
        except grpc.RpcError as e:
            raise _error(e) from None
        return r.bytes_written

    async def read_file_to(self, path: Path, dst) -> int:
        """As :meth:`Sandbox.read_file_to` (``dst``'s writes are plain blocking calls)."""
        f, owned = _local_writer(dst)
        total = 0
        try:
            async for c in self.client._files.Read(
                    pb.ReadFileRequest(sandbox_id=self.id, path=_path(path))):
                f.write(c.data)
                total += len(c.data)
        except grpc.RpcError as e:
            raise _error(e) from None
        finally:
            if owned is not None:
                owned.close()
        return total

    async def write_file_from(self, path: Path, src, *, mode: Optional[int] = None,
                              create_parents: bool = False) -> int:
        """As :meth:`Sandbox.write_file_from` (``src``'s reads are plain blocking calls)."""
        chunks, local_mode, owned = _local_reader(src)
        if mode is None:
            mode = local_mode or 0
        try:
            return await self.write_file(path, chunks, mode=mode,
                                         create_parents=create_parents)
        finally:
            if owned is not None:
                owned.close()

    async def list_dir(self, path: Path) -> List[FileInfo]:
        r = await self.client._call(self.client._files.List,
                                    pb.ListDirRequest(sandbox_id=self.id, path=_path(path)))
        return [FileInfo._from(f) for f in r.entries]

    async def session(self, *, shell: str = "", env: Optional[Mapping[str, str]] = None,
                      workdir: str = "") -> "AsyncSession":
        info = await self.client._call(self.client._sessions.Create, pb.CreateSessionRequest(
            sandbox_id=self.id, shell=shell, env=dict(env or {}), workdir=workdir))
        return AsyncSession(self, info.session_id)

    async def open_port(self, port: int) -> AsyncPortStream:
        """A TCP connection to 127.0.0.1:``port`` inside the sandbox (see
        :meth:`Sandbox.open_port`)."""
        if not self.info.access_token and not self.client.target.startswith("unix:"):
            s = await self.client._call(self.client._sandboxes.Get,
                                        pb.GetSandboxRequest(sandbox_id=self.id))
            self.info = SandboxInfo._from(s)
        return await AsyncPortStream._open(self.id, port, self.client._ports,
                                           self.info.access_token)

    async def port_url(self, port: int) -> PortUrl:
        _check_port(port)
        r = await self.client._call(self.client._ports.Url,
                                    pb.PortUrlRequest(sandbox_id=self.id, port=port))
        return PortUrl(r.url, r.host, r.address, r.access_token)

    async def url(self, port: int) -> str:
        return (await self.port_url(port)).url

    async def set_network_policy(self, allow: Iterable[str] = (), deny: Iterable[str] = (),
                                 allow_internet: bool = False) -> SandboxInfo:
        """See :meth:`Sandbox.set_network_policy`."""
        self.info = SandboxInfo._from(await self.client._call(
            self.client._network.SetNetworkPolicy,
            pb.SetNetworkPolicyRequest(sandbox_id=self.id,
                                       network=_network_policy(allow, deny, allow_internet))))
        return self.info

    async def pause(self) -> SandboxInfo:
        self.info = SandboxInfo._from(await self.client._call(
            self.client._sandboxes.Pause, pb.PauseSandboxRequest(sandbox_id=self.id)))
        return self.info

    async def resume(self) -> SandboxInfo:
        self.info = SandboxInfo._from(await self.client._call(
            self.client._sandboxes.Resume, pb.ResumeSandboxRequest(sandbox_id=self.id)))
        return self.info

    async def fork(self, count: int = 1) -> List["AsyncSandbox"]:
        r = await self.client._call(self.client._sandboxes.Fork,
                                    pb.ForkSandboxRequest(sandbox_id=self.id, count=count))
        return [AsyncSandbox(self.client, SandboxInfo._from(s)) for s in r.sandboxes]

    async def delete(self) -> None:
        await self.client._call(self.client._sandboxes.Delete,
                                pb.DeleteSandboxRequest(sandbox_id=self.id))


class AsyncPortStream:
    """asyncio twin of :class:`PortStream` (:meth:`AsyncSandbox.open_port`)."""

    def __init__(self, call):
        self._call = call
        self._write_closed = False
        self._read_closed = False

    @classmethod
    async def _open(cls, sandbox_id: str, port: int, stub: rpc.PortsStub,
                    token: str = "") -> "AsyncPortStream":
        request = _port_open(sandbox_id, port, token)
        call = stub.Open()
        try:
            await call.write(request)
            first = await call.read()
        except grpc.RpcError as e:
            raise _error(e) from None
        if first is grpc.aio.EOF or first.WhichOneof("kind") != "connected":
            call.cancel()
            raise Unavailable(grpc.StatusCode.UNAVAILABLE,
                              "the port stream ended before the connection was made")
        return cls(call)

    async def send(self, data: bytes) -> None:
        if self._write_closed:
            raise FailedPrecondition(grpc.StatusCode.FAILED_PRECONDITION,
                                     "send after close_write: the write side is closed")
        try:
            for m in _port_data(data):
                await self._call.write(m)
        except grpc.RpcError as e:
            raise _error(e) from None

    async def close_write(self) -> None:
        if not self._write_closed:
            self._write_closed = True
            try:
                await self._call.write(_PORT_EOF)
                await self._call.done_writing()
            except grpc.RpcError as e:
                raise _error(e) from None

    async def recv(self) -> bytes:
        """The next bytes from the server; ``b""`` once it has closed its side."""
        while not self._read_closed:
            try:
                r = await self._call.read()
            except grpc.RpcError as e:
                raise _error(e) from None
            if r is grpc.aio.EOF:
                self._read_closed = True
                break
            kind = r.WhichOneof("kind")
            if kind == "data":
                return r.data
            if kind == "eof":
                self._read_closed = True
        return b""

    async def read_all(self) -> bytes:
        parts = []
        while True:
            data = await self.recv()
            if not data:
                return b"".join(parts)
            parts.append(data)

    def close(self) -> None:
        """Drops the connection (both directions) at once."""
        self._call.cancel()

    async def __aenter__(self) -> "AsyncPortStream":
        return self

    async def __aexit__(self, *exc) -> None:
        self.close()


class AsyncSession:
    def __init__(self, sandbox: AsyncSandbox, session_id: str):
        self.sandbox = sandbox
        self.id = session_id

    async def run(self, command: str, *, timeout: Optional[float] = None, wait: bool = True,
                  output_limit: int = 0) -> CommandResult:
        r = await self.sandbox.client._call(self.sandbox.client._sessions.Run,
                                            pb.RunInSessionRequest(
            sandbox_id=self.sandbox.id, session_id=self.id, command=command,
            timeout_ms=_timeout_ms(timeout), wait=wait,
            output_limit=output_limit))
        return CommandResult._from(r)

    async def read_output(self, command_id: int = 0, *, wait: bool = False) -> CommandResult:
        r = await self.sandbox.client._call(self.sandbox.client._sessions.ReadOutput,
                                            pb.ReadOutputRequest(
            sandbox_id=self.sandbox.id, session_id=self.id, command_id=command_id, wait=wait))
        return CommandResult._from(r)

    async def close(self) -> None:
        await self.sandbox.client._call(self.sandbox.client._sessions.Close,
                                        pb.CloseSessionRequest(sandbox_id=self.sandbox.id,
                                                               session_id=self.id))
