"""DSec Python SDK: create sandboxes on a DSec node, run commands, move files, keep shell
sessions, pause/resume/fork. Sync (:class:`Client`) and asyncio (:class:`AsyncClient`)."""

from .client import (DEFAULT_TARGET, AsyncClient, AsyncExecStream, AsyncSandbox, AsyncSession,
                     Client, CommandResult, DsecError, ExecEvent, ExecResult, ExecStream,
                     FailedPrecondition, FileInfo, InvalidArgument, NotFound, Pty,
                     ResourceExhausted, Sandbox, SandboxInfo, Session, Unavailable,
                     Unimplemented, default_target)

__all__ = [
    "DEFAULT_TARGET", "AsyncClient", "AsyncExecStream", "AsyncSandbox", "AsyncSession", "Client",
    "CommandResult", "DsecError", "ExecEvent", "ExecResult", "ExecStream", "FailedPrecondition",
    "FileInfo", "InvalidArgument", "NotFound", "Pty", "ResourceExhausted", "Sandbox",
    "SandboxInfo", "Session", "Unavailable", "Unimplemented", "default_target",
]
__version__ = "0.1.0"
