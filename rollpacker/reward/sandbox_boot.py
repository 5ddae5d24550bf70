"""First code run inside a sandboxed program's interpreter (``python -I -c <this file>``).

It installs an audit hook, which Python cannot remove, and then runs
``solution.py`` from the working directory as ``__main__``.  The hook is the
policy layer: it turns network use, process creation, signals to other
processes, writes outside the working directory and peeking at other
processes through /proc into an immediate exit with VIOLATION_EXIT and a
``SANDBOX_VIOLATION:`` line on stderr.  The kernel-level limits set by
``sandbox.py`` (a non-root uid, so that its rlimits and file permissions bind,
read-only mounts, network namespace, session kill) are the boundary that holds
even against code that gets past the hook.

The hook keeps its own references to the few functions it calls, bound as
default arguments, so a program that rebinds ``os._exit`` cannot disarm it.
"""
import errno
import os
import sys

VIOLATION_EXIT = 86  # sandbox.py reads this constant from here
VIOLATION_MARK = "SANDBOX_VIOLATION:"
_DENIED_EVENTS = frozenset({
    "socket.__new__", "socket.connect", "socket.bind", "socket.getaddrinfo", "socket.sendto",
    "os.fork", "os.forkpty", "os.exec", "os.posix_spawn", "os.spawn", "os.system", "subprocess.Popen",
    "os.killpg", "resource.setrlimit", "resource.prlimit", "os.chroot", "os.setuid", "os.setgid",
    "ctypes.dlopen", "ctypes.dlsym", "ctypes.cdata",
})
# Foreign calls and the raw fork primitive bypass every event above.
_DENIED_MODULES = frozenset({"ctypes", "_ctypes", "_posixsubprocess"})
_PATH_WRITE_EVENTS = frozenset({
    "os.remove", "os.rename", "os.mkdir", "os.rmdir", "os.chmod", "os.chown", "os.link",
    "os.symlink", "os.truncate", "os.utime", "os.mkfifo", "os.mknod",
})
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
_WRITABLE_DEVICES = ("/dev/null", "/dev/stdout", "/dev/stderr")


def violate(what, _exit=os._exit, _write=os.write):
    _write(2, f"\n{VIOLATION_MARK} {what}\n".encode())
    _exit(VIOLATION_EXIT)


def make_hook(workdir, own_pid, violate=violate, _realpath=os.path.realpath, _fsdecode=os.fsdecode):
    own_proc = f"/proc/{own_pid}"

    def outside(path):
        real = _realpath(_fsdecode(path))
        return real != workdir and not real.startswith(workdir + "/") and real not in _WRITABLE_DEVICES

    def other_process(path):
        parts = _realpath(_fsdecode(path)).split("/")
        return len(parts) > 2 and parts[1] == "proc" and parts[2].isdigit() and "/".join(parts[:3]) != own_proc

    def hook(event, args):
        if event in _DENIED_EVENTS:
            violate(event)
        elif event == "import" and args[0] in _DENIED_MODULES:
            violate(f"import {args[0]}")
        elif event == "os.kill" and args[0] != own_pid:
            violate(f"os.kill of pid {args[0]}")
        elif event == "open" and isinstance(args[0], (str, bytes)):
            flags = args[2] if isinstance(args[2], int) else 0
            if flags & _WRITE_FLAGS and outside(args[0]):
                violate(f"write outside the working directory: {_fsdecode(args[0])}")
            if other_process(args[0]):
                violate(f"read of another process: {_fsdecode(args[0])}")
        elif event in _PATH_WRITE_EVENTS:
            for path in args[:2]:
                if isinstance(path, (str, bytes)) and outside(path):
                    violate(f"{event} outside the working directory: {_fsdecode(path)}")

    return hook


def main():
    workdir = os.path.realpath(os.getcwd())
    with open("solution.py", encoding="utf-8") as f:
        code = compile(f.read(), "solution.py", "exec")
    sys.argv = ["solution.py"]
    sys.addaudithook(make_hook(workdir, os.getpid()))
    try:
        exec(code, {"__name__": "__main__", "__builtins__": __builtins__})
    except MemoryError:
        violate("memory limit exceeded")
    except OSError as exc:
        if exc.errno != errno.EFBIG:  # Python ignores SIGXFSZ: the file-size rlimit surfaces here
            raise
        violate("file size limit exceeded")


if __name__ == "__main__":
    main()
