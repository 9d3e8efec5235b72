"""DSec Python SDK: create sandboxes on a DSec node, run commands, move files, keep shell
sessions, pause/resume/fork, reach servers inside sandboxes (port streams, HTTP URLs). Sync
(:class:`Client`) and asyncio (:class:`AsyncClient`)."""

from .client import (DEFAULT_TARGET, AsyncClient, AsyncExecStream, AsyncPortStream,
                     AsyncSandbox, AsyncSession, Client, CommandResult, DsecError, ExecEvent,
                     ExecResult, ExecStream, FailedPrecondition, FileInfo, InvalidArgument,
                     NotFound, PermissionDenied, PortStream, PortUrl, Pty, ResourceExhausted, Sandbox,
                     SandboxInfo, Session, Unauthenticated, Unavailable, Unimplemented,
                     default_target)

__all__ = [
    "DEFAULT_TARGET", "AsyncClient", "AsyncExecStream", "AsyncPortStream", "AsyncSandbox",
    "AsyncSession", "Client", "CommandResult", "DsecError", "ExecEvent", "ExecResult",
    "ExecStream", "FailedPrecondition", "FileInfo", "InvalidArgument", "NotFound",
    "PermissionDenied", "PortStream", "PortUrl", "Pty", "ResourceExhausted", "Sandbox",
    "SandboxInfo", "Session", "Unauthenticated", "Unavailable", "Unimplemented",
    "default_target",
]
__version__ = "0.1.0"
