"""Where a process's CPU goes below Python: ``perf``'s on-CPU samples sorted into the kernel's work (by system call,
interrupts, page faults) and the user side's (the interpreter, its allocator and garbage collector, uvloop and
libuv, httptools, orjson, the tokenizer, libc), and ``perf stat``'s counts of system calls.

Why perf and not only py-spy: py-spy's ``--nonblocking`` samples count a thread that is runnable but waiting for
a core as active, with its stack where it stopped (a loop just back from ``epoll_wait``, no Python frame): on a
busy machine that wait, not CPU, filled the stages benchmark's "event loop". ``perf record -e cpu-clock`` samples a
thread only while it runs. Its user stacks are cut short (the interpreter is built without frame pointers), so a
user sample is placed by its leaf function; a kernel sample by the system call its kernel stack is under.

    perf record -e cpu-clock -F 999 -g -p PID -o x.data      (SIGINT ends it)
    perf script -i x.data -F tid,ip,sym,dso                  (what ``samples`` reads)
    perf stat -x, -e raw_syscalls:sys_enter,syscalls:sys_enter_write,... -p PID
"""

from __future__ import annotations

import collections
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

# The categories, the kernel's first, in the order a table shows them.
KERNEL_CATEGORIES = ("kernel: write", "kernel: read", "kernel: epoll", "kernel: other system calls",
                     "kernel: interrupts, scheduling", "kernel: page faults")  # fmt: skip
USER_CATEGORIES = ("interpreter: bytecode", "interpreter: objects, calls, dicts", "interpreter: allocation",
                   "garbage collector", "uvloop and libuv", "httptools", "orjson", "tokenizers",
                   "libc (malloc, memcpy) and vdso", "other user code")  # fmt: skip
CATEGORIES = (*KERNEL_CATEGORIES, *USER_CATEGORIES)

# Kernel frames that say which system call a sample is under (any frame of its kernel stack).
_WRITE = ("ksys_write", "__x64_sys_write", "do_writev", "__sys_sendto", "___sys_sendmsg", "__sys_sendmsg",
          "__x64_sys_sendto", "__x64_sys_sendmsg", "__x64_sys_writev")  # fmt: skip
_READ = ("ksys_read", "__x64_sys_read", "do_readv", "__sys_recvfrom", "___sys_recvmsg", "__sys_recvmsg",
         "__x64_sys_recvfrom", "__x64_sys_readv")  # fmt: skip
_EPOLL = ("do_epoll_wait", "do_epoll_ctl", "__x64_sys_epoll_pwait", "__x64_sys_epoll_wait", "__x64_sys_epoll_ctl")
_GC = re.compile(r"^(gc_|visit_|subtract_refs|update_refs|move_unreachable|move_legacy|deduce_unreachable|"
                 r"validate_list|handle_legacy|finalize_garbage|delete_garbage)|_?traverse")
_ALLOC = re.compile(r"alloc|Malloc|Calloc|Realloc|_Free$|^_?PyObject_Free|^free_|_Del$|GC_New|GC_Track|"
                    r"GC_UnTrack|_Py_NewReference|_Py_Dealloc|freelist|^_PyFrame_Clear|clear_slots")
_LIBC = ("libc.so", "libc-", "[vdso]", "ld-linux")


@dataclass(frozen=True)
class Sample:
    """One perf sample: its thread and its frames, leaf first, each (function, object file)."""

    tid: str
    frames: tuple[tuple[str, str], ...]

    @property
    def in_kernel(self) -> bool:
        return bool(self.frames) and _is_kernel(self.frames[0][1])


_FRAME = re.compile(r"^\t\s*[0-9a-f]+ (.*) \((.*)\)$")


def samples(lines: Iterable[str]) -> Iterator[Sample]:
    """The samples of ``perf script -F tid,ip,sym,dso``'s output: a header line (the thread, padded to five
    places: " 6984"), then one line per frame (a tab, the address, the function, the object file), leaf first, a
    blank line between samples."""
    tid: str | None = None
    frames: list[tuple[str, str]] = []
    for raw in lines:
        line = raw.rstrip("\n")
        if (m := _FRAME.match(line)) is not None:
            if tid is not None:
                frames.append((m[1].split("+0x")[0], m[2]))
            continue
        if tid is not None and frames:
            yield Sample(tid, tuple(frames))
        tid, frames = (line.strip() or None), []
    if tid is not None and frames:
        yield Sample(tid, tuple(frames))


def _is_kernel(dso: str) -> bool:
    return dso.startswith("[kernel") or dso.endswith(".ko") or "kallsyms" in dso


def category(sample: Sample) -> str:
    """The category of one sample (``CATEGORIES``)."""
    if sample.in_kernel:
        names = [f for f, d in sample.frames if _is_kernel(d)]
        for marks, name in ((_WRITE, "kernel: write"), (_READ, "kernel: read"), (_EPOLL, "kernel: epoll")):
            if any(n in marks for n in names):
                return name
        if "exc_page_fault" in names or "asm_exc_page_fault" in names:
            return "kernel: page faults"
        if "do_syscall_64" in names or "entry_SYSCALL_64_after_hwframe" in names:
            return "kernel: other system calls"
        return "kernel: interrupts, scheduling"
    leaf, dso = sample.frames[0]
    return user_category(leaf, dso)


def user_category(leaf: str, dso: str) -> str:
    """A user-space sample's category by its leaf function and object file."""
    base = dso.rsplit("/", 1)[-1]
    if "libpython" in base or base.startswith("python"):
        if leaf == "_PyEval_EvalFrameDefault":
            return "interpreter: bytecode"
        if _GC.search(leaf):
            return "garbage collector"
        if _ALLOC.search(leaf):
            return "interpreter: allocation"
        return "interpreter: objects, calls, dicts"
    if "uvloop" in dso:
        return "uvloop and libuv"
    if "httptools" in dso:
        return "httptools"
    if "orjson" in base:
        return "orjson"
    if "tokenizers" in base:
        return "tokenizers"
    if any(mark in base for mark in _LIBC):
        return "libc (malloc, memcpy) and vdso"
    return "other user code"


@dataclass(frozen=True)
class Split:
    """A profile's samples by category, and the most sampled leaf functions."""

    total: int
    by_category: dict[str, int]
    leaves: list[tuple[str, int]]  # "function (object file)" by count, most first

    def share(self, name: str) -> float:
        return self.by_category.get(name, 0) / self.total if self.total else 0.0


def split(found: Iterable[Sample], top: int = 25) -> Split:
    """Counts per category, and the ``top`` leaf functions (a kernel sample's named by its system call)."""
    cats: collections.Counter[str] = collections.Counter()
    leaves: collections.Counter[str] = collections.Counter()
    for s in found:
        name = category(s)
        cats[name] += 1
        if s.in_kernel:
            leaves[f"[{name}] {s.frames[0][0]}"] += 1
        else:
            leaves[f"{s.frames[0][0]} ({s.frames[0][1].rsplit('/', 1)[-1]})"] += 1
    return Split(sum(cats.values()), dict(cats), leaves.most_common(top))


# perf stat's events: every system call, the ones a proxy's bytes go through (a Rust proxy sends and receives
# with sendto and recvfrom, Python's loops write and read), and the context switches.
SYSCALL_EVENTS = {
    "syscalls": "raw_syscalls:sys_enter",
    **{name: f"syscalls:sys_enter_{name}" for name in (
        "write", "writev", "sendto", "sendmsg", "read", "readv", "recvfrom", "recvmsg", "epoll_pwait", "epoll_wait",
        "getpid")},
    "switches": "context-switches",
}  # fmt: skip
# What a table shows: the calls that write a socket, that read one, that wait for events.
GROUPS = {"writes": ("write", "writev", "sendto", "sendmsg"), "reads": ("read", "readv", "recvfrom", "recvmsg"),
          "epoll waits": ("epoll_pwait", "epoll_wait")}


def stat_counts(csv_lines: Iterable[str], events: dict[str, str] | None = None) -> dict[str, float]:
    """``perf stat -x,``'s counts by our names (``SYSCALL_EVENTS``); an event perf could not count is absent."""
    by_event = {v: k for k, v in (events or SYSCALL_EVENTS).items()}
    out: dict[str, float] = {}
    for line in csv_lines:
        fields = line.strip().split(",")
        if len(fields) < 3 or line.startswith("#"):
            continue
        value, event = fields[0], fields[2]
        name = by_event.get(event)
        if name is None or not re.fullmatch(r"[0-9.]+", value):
            continue
        out[name] = out.get(name, 0.0) + float(value)
    return out


def grouped(counts: dict[str, float]) -> dict[str, float]:
    """The counts with ``GROUPS`` summed in (a group is absent when none of its calls was counted)."""
    out = dict(counts)
    for group, names in GROUPS.items():
        if any(n in counts for n in names):
            out[group] = sum(counts.get(n, 0.0) for n in names)
    return out


def per_unit(counts: dict[str, float], units: float, names: Sequence[str]) -> dict[str, float]:
    """Counts per request or per token; NaN for an event not counted."""
    nan = float("nan")
    return {n: (counts[n] / units if units and n in counts else nan) for n in names}
