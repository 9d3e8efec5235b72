# FnCall zygote: runs inside a worker (its own mount, network, ipc and uts namespaces, the
# image as a read-only root). It preloads the language's runtime once, then serves one call
# at a time: start a call init (pid 1 of a fresh pid namespace, own mount namespace with fresh
# tmpfs /tmp and /work, in the worker's call cgroup), which runs the stages as an
# unprivileged uid and writes the result frame straight to the engine. Container workers
# have each call's compiled init (INIT_PATH) forked by the worker's init forker (that
# program, spawned once) and fork only the python stage; VM workers fork the
# init from this zygote (call_init below). When the call init
# exits, its pid namespace dies and takes every process of the call with it. The zygote was
# started inside the worker's cgroup, so calls are born there (moving a process between
# cgroups costs an RCU grace period: milliseconds).
#
# Frames (both ways): 4-byte big-endian length, then the payload. Engine -> zygote: a
# request (JSON for call_init below; tagged records for the compiled init). Zygote side -> engine: b"R" + JSON result (from the call init), then b"E" + the
# call init's wait status (from the zygote) once it is gone.
import os, sys, struct, signal, ctypes, json, time, select, resource, base64, io, traceback, types, builtins

LANG = sys.argv[1]
MAX_REQUEST = int(sys.argv[2])
OWN_PID_NS = int(sys.argv[3])
# The sandbox seccomp filters (BPF, hex, comma-separated), installed by every stage.
SECCOMP_HEX = sys.argv[4]
# Size (KiB) and inodes of each call's /tmp and /work: mounted before the call arrives.
WORK_KIB, WORK_INODES = int(sys.argv[5]), int(sys.argv[6])
# The host uid this worker's calls run as (the python stage drops to it before its call).
CALL_UID = int(sys.argv[7])
# "lean": python without the heavy preloads (numpy), for calls whose code does not name them
# (the engine decides); its forks and exits cost less. Absent (VM workers): "full".
PRELOAD = sys.argv[8] if len(sys.argv) > 8 else "full"
# The compiled call init (container workers: fncall/init/call_init.rs, in the worker's /dev):
# each call's init is spawned from it (vfork + exec), so a python call costs one fork of this
# interpreter (its stage), not two. Absent (VM workers): each call's init is a fork of this
# zygote running call_init below.
INIT_PATH = sys.argv[9] if len(sys.argv) > 9 else None
if INIT_PATH is not None:
    import socket, fcntl
# A ready init's exit status when the engine closed the request pipe: the zygote ends too.
EXIT_NO_MORE_CALLS = 3

if LANG == "python":
    # What reward code imports most: paid once here, not per call.
    import re, math, random, collections, itertools, functools, heapq, bisect, string
    import typing, datetime, decimal, fractions, copy, operator, statistics, dataclasses
    numpy = None
    if PRELOAD == "full":
        try:
            import numpy
        except ImportError:
            pass

libc = ctypes.CDLL(None, use_errno=True)
CLONE_NEWNS = 0x00020000
CLONE_NEWPID = 0x20000000
MS_NOSUID, MS_NODEV = 2, 4
PR_SET_NO_NEW_PRIVS = 38
PR_SET_PDEATHSIG = 1
PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 22, 2
PR_SET_NAME = 15


def set_name(name):
    """Names the process (what ps, top and perf show): zygote, call init, call stage."""
    libc.prctl(PR_SET_NAME, name, 0, 0, 0)


class SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


# Built once: a stage only makes the prctl calls.
SECCOMP_PROGRAMS = []
for _hex in filter(None, SECCOMP_HEX.split(",")):
    _code = bytes.fromhex(_hex)
    _buf = ctypes.create_string_buffer(_code, len(_code))
    SECCOMP_PROGRAMS.append((_buf, SockFprog(len(_code) // 8, ctypes.addressof(_buf))))


def check(ret, what):
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, "%s: %s" % (what, os.strerror(err)))


def mount(src, target, fstype, flags, data):
    check(libc.mount(src.encode(), target.encode(), fstype.encode(), ctypes.c_ulong(flags),
                     data.encode()), "mount " + target)


def read_exact(fd, view):
    got = 0
    while got < len(view):
        n = os.readv(fd, [view[got:]])
        if n == 0:
            return got
        got += n
    return got


def write_frame(fd, kind, payload):
    data = struct.pack(">I", len(payload) + 1) + kind + payload
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def b64(data):
    return base64.b64encode(data).decode()


# Whether this process already runs under the sandbox filters (inherited across fork).
FILTERED = [False]


def install_filters():
    """No new user namespaces, mounts, bpf, keyctl, perf, kexec, modules, io_uring, ... for
    this process and every process it forks: a call's init installs them once its mounts
    are made, so its stages inherit them instead of compiling them again."""
    if FILTERED[0]:
        return
    for _buf, prog in SECCOMP_PROGRAMS:
        check(libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0), "seccomp")
    FILTERED[0] = True


def drop_privileges(uid):
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
    check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    install_filters()


def set_limits(req):
    lim = req["limits"]
    cpu = max(1, int(req["cpu_seconds"]))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_FSIZE, (lim["file_bytes"], lim["file_bytes"]))
    resource.setrlimit(resource.RLIMIT_NOFILE, (lim["open_files"], lim["open_files"]))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_NPROC, (lim["processes"], lim["processes"]))


ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/work", "LANG": "C.UTF-8",
       "TMPDIR": "/tmp", "PYTHONDONTWRITEBYTECODE": "1"}


def run_python_here(path):
    """The call's code in this already-warm interpreter, as `python3 path` would run it."""
    os.environ.clear()
    os.environ.update(ENV)
    sys.argv = [path]
    sys.path[0] = "/work"
    sys.stdin = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)),
                                 encoding="utf-8")
    sys.stdout = io.TextIOWrapper(io.BufferedWriter(io.FileIO(1, "w", closefd=False)),
                                  encoding="utf-8")
    sys.stderr = io.TextIOWrapper(io.BufferedWriter(io.FileIO(2, "w", closefd=False)),
                                  encoding="utf-8", line_buffering=True,
                                  errors="backslashreplace")
    # Fresh randomness per call: the state forked from the zygote is the same in every call.
    random.seed()
    if numpy is not None:
        numpy.random.seed()
    # numpy imported by the call itself (lean zygote) draws its own fresh seed.
    main = types.ModuleType("__main__")
    main.__file__ = path
    main.__builtins__ = builtins
    sys.modules["__main__"] = main
    code = 0
    try:
        with open(path, "rb") as f:
            source = f.read()
        exec(compile(source, path, "exec"), main.__dict__)
    except SystemExit as e:
        if e.code is None:
            code = 0
        elif isinstance(e.code, int):
            code = e.code & 0xFF
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:
            code = code or 120
    os._exit(code)


def report_start_failure(fail_w, e):
    """Tells the parent, through the stage's failure pipe, why the stage could not start."""
    try:
        os.write(fail_w, ("cannot start the stage: %s" % e).encode())
    except OSError:
        pass


def become_stage(stdin_fd, out_w, err_w, keep, uid):
    """In a stage's process: stdio on its pipes, no descriptor but `keep`, /work as its
    directory, the call's uid and seccomp filter."""
    os.dup2(stdin_fd, 0)
    os.dup2(out_w, 1)
    os.dup2(err_w, 2)
    low = 3
    for fd in sorted(fd for fd in keep if fd is not None and fd > 2):
        os.closerange(low, fd)
        low = fd + 1
    os.closerange(low, 65536)
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    os.chdir("/work")
    drop_privileges(uid)


def fork_stage(stdin_fd, uid, then):
    """Forks a stage's process: its stdio on fresh pipes, /work as its directory, the call's
    uid and seccomp filter; it then runs `then(fail_w)` (which execs or runs python code and
    never returns). Returns what `supervise` needs."""
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    # Closed by a successful exec; a message on it means the stage never started.
    fail_r, fail_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        set_name(b"fncall-call")
        try:
            become_stage(stdin_fd, out_w, err_w, (fail_w, GO_FD[0]), uid)
            then(fail_w)
        except BaseException as e:
            report_start_failure(fail_w, e)
        os._exit(127)
    os.close(out_w)
    os.close(err_w)
    os.close(fail_w)
    return pid, out_r, err_r, fail_r


# The go pipe of a stage made ahead, kept open across its child's closerange.
GO_FD = [None]


def exec_stage(req, argv):
    def then(fail_w):
        set_limits(req)
        os.execve(argv[0], argv, ENV)
    return then


def stage(req, argv, stdin_fd, timeout):
    """Runs one exec'd stage as the call's uid; returns its result dict."""
    handle = fork_stage(stdin_fd, req["uid"], exec_stage(req, argv))
    return supervise(req, handle, timeout)


def run_when_ordered(order_r, fail_w):
    """A python stage made ahead: waits for its order (limits and the code's path; an empty
    pipe: the call never came), then runs the code in this warm interpreter."""
    msg = b""
    while True:
        chunk = os.read(order_r, 65536)
        if not chunk:
            break
        msg += chunk
    os.close(order_r)
    if not msg:
        # The call never came (or could not be set up): nothing to run.
        os.close(fail_w)
        os._exit(0)
    set_name(b"fncall-call")
    order = json.loads(msg)
    set_limits(order)
    os.close(fail_w)
    run_python_here(order["path"])


def python_ahead(stdin_fd, uid):
    """The python stage forked before its call arrives: privileges dropped, seccomp on, it
    waits on a pipe for its limits and the path of the code, then runs it in this warm
    interpreter. Returns (handle, go_w)."""
    go_r, go_w = os.pipe()
    GO_FD[0] = go_r

    def then(fail_w):
        set_name(b"fncall-ready")
        run_when_ordered(go_r, fail_w)

    try:
        handle = fork_stage(stdin_fd, uid, then)
    finally:
        GO_FD[0] = None
        os.close(go_r)
    return handle, go_w


def supervise(req, handle, timeout):
    """Collects a started stage's output up to the cap and its status, killing it at the
    wall-time limit and everything it left behind after."""
    pid, out_r, err_r, fail_r = handle
    cap = req["limits"]["output_bytes"]
    started = time.monotonic()
    pidfd = os.pidfd_open(pid)
    deadline = started + timeout
    bufs = {out_r: bytearray(), err_r: bytearray()}
    truncated = {out_r: False, err_r: False}
    open_fds = [out_r, err_r]
    timed_out = False
    exited = False
    poller = select.poll()
    for fd in open_fds:
        poller.register(fd, select.POLLIN)
    poller.register(pidfd, select.POLLIN)
    while open_fds and not exited:
        left = deadline - time.monotonic()
        if left <= 0:
            timed_out = True
            break
        for fd, _ in poller.poll(left * 1000):
            if fd == pidfd:
                exited = True
                continue
            chunk = os.read(fd, 65536)
            if chunk:
                room = cap - len(bufs[fd])
                bufs[fd] += chunk[:room]
                if len(chunk) > room:
                    # Over the cap: stop reading, the writer gets SIGPIPE / EPIPE.
                    truncated[fd] = True
            if not chunk or truncated[fd]:
                poller.unregister(fd)
                os.close(fd)
                open_fds.remove(fd)
    if timed_out:
        os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    elapsed = time.monotonic() - started
    # Whatever the stage left behind (background processes) goes with it: we are pid 1 of
    # the call's namespace (checked: kill(-1) anywhere else would reach far more).
    if os.getpid() == 1:
        try:
            os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for fd in open_fds:
        # Writers are gone: drain what is buffered, up to the cap.
        while True:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            room = cap - len(bufs[fd])
            bufs[fd] += chunk[:room]
            if len(chunk) > room:
                truncated[fd] = True
                break
        os.close(fd)
    os.close(pidfd)
    result = {"time": elapsed, "stdout": b64(bytes(bufs[out_r])), "stderr": b64(bytes(bufs[err_r])),
              "stdout_truncated": truncated[out_r], "stderr_truncated": truncated[err_r],
              "exit_code": None, "signal": None,
              "status": "TimeLimitExceeded" if timed_out else "Finished"}
    if os.WIFEXITED(status):
        result["exit_code"] = os.WEXITSTATUS(status)
    elif os.WIFSIGNALED(status):
        result["signal"] = os.WTERMSIG(status)
        if result["signal"] == signal.SIGXCPU and not timed_out:
            result["status"] = "TimeLimitExceeded"
    failure = os.read(fail_r, 4096)
    os.close(fail_r)
    if failure:
        result["status"] = "Error"
        result["stderr"] = b64(failure)
    return result


def inside_work(name):
    # The engine checks names too; this runs as root, so check again.
    path = os.path.normpath(os.path.join("/work", name))
    if not path.startswith("/work/"):
        raise ValueError("file name %r leaves the working directory" % name)
    return path


def prepare_call_namespace():
    """Pid 1 of a call to come: fresh mount namespace, empty /tmp and /work, its /proc."""
    if os.getpid() != 1:
        raise RuntimeError("the call's init is not pid 1 of its own pid namespace")
    check(libc.unshare(CLONE_NEWNS), "unshare mount namespace")
    tmpfs = "size=%dk,nr_inodes=%d,mode=1777" % (WORK_KIB, WORK_INODES)
    mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, tmpfs)
    mount("tmpfs", "/work", "tmpfs", MS_NOSUID | MS_NODEV, tmpfs)
    mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | 8, "")  # 8: MS_NOEXEC
    os.close(OWN_PID_NS)


def read_request():
    """The next request frame from the engine (fd 0), or None when it closed the pipe."""
    header = bytearray(4)
    if read_exact(0, memoryview(header)) < 4:
        return None
    size = struct.unpack(">I", header)[0]
    if size > MAX_REQUEST:
        return None
    body = bytearray(size)
    if read_exact(0, memoryview(body)) < size:
        return None
    return body


def call_init(req, ahead):
    """The call in its prepared namespace: the files, then the stages. `ahead`: the python
    stage already forked and waiting (handle, go pipe, stdin memfd), or None."""
    uid = req["uid"]
    if uid != CALL_UID:
        raise ValueError("the request's uid %d is not this worker's %d" % (uid, CALL_UID))
    os.chown("/work", uid, uid)
    for name, data in req["files"].items():
        path = inside_work(name)
        if os.path.dirname(path) != "/work":
            os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(base64.b64decode(data))
        os.chown(path, uid, uid)
    empty_fd = os.open("/dev/null", os.O_RDONLY)
    stdin_fd = empty_fd
    if req["stdin"]:
        # Not a pipe: the whole input is there at once, and no writer can block.
        stdin_fd = ahead[2] if ahead is not None else os.memfd_create("stdin")
        os.write(stdin_fd, base64.b64decode(req["stdin"]))
        os.lseek(stdin_fd, 0, 0)
    result = {"compile": None, "run": None, "files": {}, "errors": []}
    lang = req["language"]
    if lang == "python":
        handle, go_w, _ = ahead
        order = {"path": "/work/" + req["main"], "limits": req["limits"],
                 "cpu_seconds": req["cpu_seconds"]}
        os.write(go_w, json.dumps(order).encode())
        os.close(go_w)
        run = supervise(req, handle, req["run_timeout"])
    elif lang == "bash":
        run = stage(req, ["/bin/bash", req["main"]], stdin_fd, req["run_timeout"])
    elif lang == "node":
        run = stage(req, ["/usr/bin/node", req["main"]], stdin_fd, req["run_timeout"])
    elif lang == "cpp":
        compiled = stage(req, ["/usr/bin/g++", "-O2", "-std=c++17", "-o", "/work/a.out", req["main"]],
                         empty_fd, req["compile_timeout"])
        result["compile"] = compiled
        run = None
        if compiled["status"] == "Finished" and compiled["exit_code"] == 0:
            run = stage(req, ["/work/a.out"], stdin_fd, req["run_timeout"])
    else:
        raise ValueError("language %r has no runner" % lang)
    result["run"] = run
    # Files to hand back, read as the call's uid (a symlink cannot reach more than it could).
    drop_privileges(uid)
    lim = req["limits"]
    budget = lim["fetch_bytes"]
    for name in req["fetch"]:
        path = inside_work(name)
        try:
            with open(path, "rb") as f:
                data = f.read(budget + 1)
        except OSError as e:
            result["errors"].append("%s: %s" % (name, e.strerror))
            continue
        if len(data) > budget:
            result["errors"].append("%s: over the %d bytes left for fetched files" % (name, lim["fetch_bytes"]))
            continue
        budget -= len(data)
        result["files"][name] = b64(data)
    return result


def ready_init(go_r):
    """A call's init made ahead of its call: namespaces and mounts ready, it waits for its
    turn (the previous call gone), then reads the request itself and answers."""
    set_name(b"fncall-init")
    ahead = None
    try:
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        prepare_call_namespace()
        # The zygote is shielded from the OOM killer; the call is its first choice.
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("1000")
        # Nothing below mounts or enters a namespace: the init and its stages are filtered.
        install_filters()
        if LANG == "python":
            # The call's process made now: its fork is off the call's path.
            stdin_fd = os.memfd_create("stdin")
            handle, go_w = python_ahead(stdin_fd, CALL_UID)
            ahead = (handle, go_w, stdin_fd)
        setup_error = None
    except BaseException as e:
        setup_error = e
    if os.read(go_r, 1) != b"g":
        os._exit(EXIT_NO_MORE_CALLS)
    os.close(go_r)
    body = read_request()
    if body is None:
        os._exit(EXIT_NO_MORE_CALLS)
    try:
        if setup_error is not None:
            raise setup_error
        result = call_init(json.loads(bytes(body)), ahead)
    except BaseException as e:
        result = {"error": "%s: %s" % (type(e).__name__, e)}
    del body
    write_frame(1, b"R", json.dumps(result).encode())
    os._exit(0)


def prepare():
    """Forks the next call's init into a fresh pid namespace; returns its pid and the pipe
    that tells it its turn has come."""
    go_r, go_w = os.pipe()
    check(libc.unshare(CLONE_NEWPID), "unshare pid namespace")
    pid = os.fork()
    if pid == 0:
        os.close(go_w)
        ready_init(go_r)
    os.close(go_r)
    check(libc.setns(OWN_PID_NS, CLONE_NEWPID), "back to the zygote's pid namespace")
    return pid, go_w


# Compiled-init mode. Per call: the init is forked by the init forker (pid 1 of a fresh pid
# namespace, this zygote its parent), makes
# its mounts and says "r" on its socket; the python stage is forked from here into that pid
# namespace and the init's mount namespace (pid 2 there), drops to the call's uid, filters
# itself and waits for its order from the init. The zygote reaps the stage (its parent) and
# hands the init its wait status ("x"); it never reads a request nor a call's output.
STAGE_FDS = 5  # the init's fds 4-8: stdout, stderr, order, failure (read/write ends), stdin


def high_fd(fd):
    """A copy of fd above the spawn's targets (3-8), so dup2 never overwrites a source."""
    copy = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 16)
    os.close(fd)
    return copy


def send(sock, message):
    try:
        sock.send(message, socket.MSG_NOSIGNAL)
    except OSError:
        pass


SYS_PIDFD_GETFD = 438


def fork_stage_into(init_pid, root_number, order_r, out_w, err_w, fail_w, stdin_fd):
    """Forks the python stage into the init's namespaces (pid namespace and mount namespace:
    setns through the init's pidfd; for the mount namespace, then a chroot to the
    init's root, whose descriptor is taken from the init: setns alone sets the namespace's
    first root, which is not the worker's image when the engine runs chrooted)."""
    init_fd = os.pidfd_open(init_pid)
    root_fd = -1
    try:
        root_fd = libc.syscall(SYS_PIDFD_GETFD, init_fd, root_number, 0)
        if root_fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, "pidfd_getfd of the init's root: %s" % os.strerror(err))
        check(libc.setns(init_fd, CLONE_NEWPID), "enter the call's pid namespace")
        pid = -1
        try:
            pid = os.fork()
        finally:
            if pid != 0:
                check(libc.setns(OWN_PID_NS, CLONE_NEWPID), "back to the zygote's pid namespace")
        if pid == 0:
            set_name(b"fncall-ready")
            try:
                libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
                check(libc.setns(init_fd, CLONE_NEWNS), "enter the call's mount namespace")
                os.fchdir(root_fd)
                os.chroot(".")
                os.close(root_fd)
                # The zygote is shielded from the OOM killer; the call is its first choice.
                with open("/proc/self/oom_score_adj", "w") as f:
                    f.write("1000")
                become_stage(stdin_fd, out_w, err_w, (fail_w, order_r), CALL_UID)
                run_when_ordered(order_r, fail_w)
            except BaseException as e:
                report_start_failure(fail_w, e)
            os._exit(127)
        return pid
    finally:
        os.close(init_fd)
        if root_fd >= 0:
            os.close(root_fd)


def start_forker():
    """Spawns the worker's init forker (the compiled init in its serving mode): it forks each
    call's init into a fresh pid namespace, a child of this zygote. Returns its socket."""
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    theirs_fd = high_fd(theirs.detach())
    try:
        os.posix_spawn(INIT_PATH, [INIT_PATH, "serve", SECCOMP_HEX, str(WORK_KIB),
                                   str(WORK_INODES), str(CALL_UID), LANG], {},
                       file_actions=[(os.POSIX_SPAWN_DUP2, theirs_fd, 3)])
    finally:
        os.close(theirs_fd)
    return mine


def spawn_init(forker):
    """Has the forker fork the next call's init (pid 1 of a fresh pid namespace) and, for
    python, forks its stage into it. Returns (init pid, socket to it, stage pid or None)."""
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sources = [theirs.detach()]
    stage_ends = None
    if LANG == "python":
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        order_r, order_w = os.pipe()
        fail_r, fail_w = os.pipe()
        stdin_fd = os.memfd_create("stdin")
        sources += [out_r, err_r, order_w, fail_r, os.dup(stdin_fd)]
        stage_ends = (order_r, out_w, err_w, fail_w, stdin_fd)
    try:
        # The init gets them as its fds 3, 4, ...
        socket.send_fds(forker, [b"c"], sources)
        answer = forker.recv(4096)
    finally:
        for fd in sources:
            os.close(fd)
    if answer[:1] != b"p":
        if stage_ends is not None:
            for fd in stage_ends:
                os.close(fd)
        raise OSError("the init forker could not fork a call's init: %r" % answer[1:].decode(errors="replace"))
    pid = int(answer[1:])
    ready = b""
    try:
        ready = mine.recv(4096)
    except OSError:
        pass
    stage_pid = None
    if stage_ends is not None:
        if ready[:1] == b"r":
            try:
                stage_pid = fork_stage_into(pid, int(ready[1:]), *stage_ends)
                send(mine, b"s")
            except OSError as e:
                send(mine, b"n" + str(e).encode())
        for fd in stage_ends:
            os.close(fd)
    return pid, mine, stage_pid


def serve_with_compiled_init():
    # Stage pid -> its init's socket: where its wait status goes once reaped.
    stages = {}
    ended = {}

    def reap_until(target):
        while target not in ended:
            pid, status = os.waitpid(-1, 0)
            sock = stages.pop(pid, None)
            if sock is not None:
                send(sock, b"x" + struct.pack(">i", status))
            ended[pid] = status
        return ended.pop(target)

    forker = start_forker()

    def next_init():
        pid, sock, stage_pid = spawn_init(forker)
        if stage_pid is not None:
            stages[stage_pid] = sock
        return pid, sock, stage_pid

    current = next_init()
    write_frame(1, b"H", b"")
    while True:
        pid, sock, stage_pid = current
        send(sock, b"g")
        if stage_pid is not None:
            # The stage's status goes to its init first; the next init is made meanwhile
            # it answers.
            reap_until(stage_pid)
        current = next_init()
        status = reap_until(pid)
        sock.close()
        if os.WIFEXITED(status) and os.WEXITSTATUS(status) == EXIT_NO_MORE_CALLS:
            return
        write_frame(1, b"E", struct.pack(">i", status))


def main():
    set_name(b"fncall-zygote")
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    if INIT_PATH is not None:
        serve_with_compiled_init()
        return
    # The zygote never reads a request: each call's init reads its own, so nothing of a
    # call is ever in the memory the next call is forked from.
    current = prepare()
    write_frame(1, b"H", b"")
    while True:
        pid, go_w = current
        os.write(go_w, b"g")
        os.close(go_w)
        # The next init gets ready while this one waits for and serves its call.
        current = prepare()
        _, status = os.waitpid(pid, 0)
        if os.WIFEXITED(status) and os.WEXITSTATUS(status) == EXIT_NO_MORE_CALLS:
            return
        write_frame(1, b"E", struct.pack(">i", status))


main()
