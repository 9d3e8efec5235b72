# FnCall VM worker: runs inside a microVM (started by the guest agent when the kernel command
# line has dsec.fnworker=PORT), as root of a VM that exists for one call.
#
# Boot (once per template): listen on vsock PORT; the host connects and sends the zygote's
# argv and source; the zygote is loaded (its runtime imported: python's stdlib modules, numpy
# if present) without starting it; "P" answers that it is warm, the host closes and takes the
# snapshot while this process waits in accept().
# Call (once per restored copy): the host connects and sends fresh entropy and its clock; the
# kernel's random pool is reseeded (every copy starts from the same snapshot), the clock set,
# the call's memory bounded by a cgroup of its own (memory.max; the zygote and every process
# of the call in it; on failure an "X" frame says why and the call is not run), the connection becomes fds 0 and 1 and the zygote's main loop runs: hello, one request,
# its result (frames as in zygote.py). The host then kills the VM.
import os, sys, socket, struct, json, base64, ctypes, ast, fcntl, time

PORT = int(sys.argv[1])
# Bound on the boot and call preambles (the zygote's source is ~20 KiB).
MAX_PREAMBLE = 1 << 20
RNDADDENTROPY = 0x40085203
RNDRESEEDCRNG = 0x5207
CLOCK_REALTIME = 0


def read_exact(conn, size):
    data = bytearray()
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            raise EOFError("the host closed the connection")
        data += chunk
    return bytes(data)


def read_frame(conn):
    size = struct.unpack(">I", read_exact(conn, 4))[0]
    if size > MAX_PREAMBLE:
        raise ValueError("preamble of %d bytes" % size)
    return json.loads(read_exact(conn, size))


def reseed(entropy):
    info = struct.pack("ii", len(entropy) * 8, len(entropy)) + entropy
    with open("/dev/urandom", "wb", buffering=0) as urandom:
        fcntl.ioctl(urandom, RNDADDENTROPY, info)
        fcntl.ioctl(urandom, RNDRESEEDCRNG)


def set_clock(realtime_ns):
    class Timespec(ctypes.Structure):
        _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]
    libc = ctypes.CDLL(None, use_errno=True)
    ts = Timespec(realtime_ns // 1_000_000_000, realtime_ns % 1_000_000_000)
    libc.clock_settime(CLOCK_REALTIME, ctypes.byref(ts))


def limit_memory(memory_mib):
    """Moves this process (the zygote-to-be, so every process of the call) into a cgroup whose
    memory.max is the call's limit; swap is off in the VM."""
    root = "/sys/fs/cgroup"
    if not os.path.exists(root + "/cgroup.controllers"):
        os.makedirs(root, exist_ok=True)
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.mount(b"cgroup2", root.encode(), b"cgroup2", 0, None) != 0:
            raise OSError(ctypes.get_errno(), "mount cgroup2 on " + root)
    with open(root + "/cgroup.subtree_control", "w") as f:
        f.write("+memory")
    call = root + "/call"
    os.makedirs(call, exist_ok=True)
    with open(call + "/memory.max", "w") as f:
        f.write(str(memory_mib << 20))
    with open(call + "/cgroup.procs", "w") as f:
        f.write(str(os.getpid()))


def load_zygote(boot):
    """The zygote's module body without its final main() call: everything it preloads."""
    tree = ast.parse(boot["zygote"], "zygote.py")
    last = tree.body[-1] if tree.body else None
    if not (isinstance(last, ast.Expr) and isinstance(last.value, ast.Call)
            and getattr(last.value.func, "id", None) == "main"):
        raise ValueError("zygote.py does not end with main()")
    tree.body.pop()
    pid_ns = os.open("/proc/self/ns/pid", os.O_RDONLY)
    args = boot["args"]
    sys.argv = ["zygote.py", args["language"], str(args["max_request"]), str(pid_ns),
                args["seccomp_hex"], str(args["work_kib"]), str(args["work_inodes"]),
                str(args["call_uid"])]
    namespace = {"__name__": "zygote", "__builtins__": __builtins__}
    exec(compile(tree, "zygote.py", "exec"), namespace)
    return namespace


def main():
    os.environ.clear()
    os.environ.update({"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "OPENBLAS_NUM_THREADS": "1",
                       "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"})
    os.makedirs("/work", exist_ok=True)
    listener = socket.socket(socket.AF_VSOCK, socket.SOCK_STREAM)
    listener.bind((socket.VMADDR_CID_ANY, PORT))
    listener.listen(4)
    conn, _ = listener.accept()
    zygote = load_zygote(read_frame(conn))
    conn.sendall(struct.pack(">I", 1) + b"P")
    # Wait for the host to close: the snapshot is taken after that, with no live connection.
    while conn.recv(4096):
        pass
    conn.close()
    # The host snapshots once it reads this on the console (fncall/src/vm/mod.rs WARM_LINE).
    with open("/dev/console", "wb", buffering=0) as console:
        console.write(b"dsec-fnworker warm\n")
    while True:
        conn, _ = listener.accept()
        try:
            call = read_frame(conn)
            break
        except (EOFError, ValueError, OSError):
            conn.close()
    reseed(base64.b64decode(call["entropy"]))
    set_clock(int(call["realtime_ns"]))
    try:
        limit_memory(int(call["memory_mib"]))
    except (OSError, ValueError, KeyError) as e:
        why = ("the call's memory limit: %s" % e).encode()[:4000]
        conn.sendall(struct.pack(">I", 1 + len(why)) + b"X" + why)
        sys.exit(1)
    os.dup2(conn.fileno(), 0)
    os.dup2(conn.fileno(), 1)
    conn.close()
    listener.close()
    zygote["main"]()


main()
