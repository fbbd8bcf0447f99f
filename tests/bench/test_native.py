"""perf's samples of a proxy are split by what ran: the kernel by the system call it served, the user side by
library; perf stat's counts are read by name and per unit."""

from __future__ import annotations

import math

import pytest

from bench.workloads.native import (
    CATEGORIES,
    Sample,
    category,
    grouped,
    per_unit,
    samples,
    split,
    stat_counts,
    user_category,
)

KERNEL = "[kernel.kallsyms]"
PY = "/root/.pyenv/versions/3.11.7/lib/libpython3.11.so.1.0"
UVLOOP = "/x/site-packages/uvloop/loop.cpython-311-x86_64-linux-gnu.so"

SCRIPT = f"""25028
\tffffffff81e7 _raw_spin_unlock_irqrestore ({KERNEL})
\tffffffff81e8 tcp_sendmsg ({KERNEL})
\tffffffff81e9 sock_write_iter ({KERNEL})
\tffffffff81ea vfs_write ({KERNEL})
\tffffffff81eb ksys_write ({KERNEL})
\tffffffff81ec do_syscall_64 ({KERNEL})
\t10adc7 __GI___libc_write (/usr/lib/x86_64-linux-gnu/libc.so.6)

25028
\t19d5c2 _PyEval_EvalFrameDefault ({PY})
\t7f57f46a5a40 [unknown] ([unknown])

 6984
\t1257c0 uv_timer_stop+0x10 ({UVLOOP})
"""


def test_a_perf_script_is_read_as_samples_leaf_first() -> None:
    found = list(samples(SCRIPT.splitlines()))
    assert [s.tid for s in found] == ["25028", "25028", "6984"]  # perf pads a short thread id with spaces
    assert found[0].frames[0] == ("_raw_spin_unlock_irqrestore", KERNEL) and found[0].in_kernel
    assert found[2].frames == (("uv_timer_stop", UVLOOP),)  # the offset is not part of the name


@pytest.mark.parametrize(("frames", "expected"), [
    (["tcp_sendmsg", "sock_write_iter", "ksys_write", "do_syscall_64"], "kernel: write"),
    (["tcp_sendmsg", "__sys_sendto", "__x64_sys_sendto", "do_syscall_64"], "kernel: write"),
    (["tcp_recvmsg", "sock_read_iter", "ksys_read", "do_syscall_64"], "kernel: read"),
    (["ep_send_events", "do_epoll_wait", "__x64_sys_epoll_pwait", "do_syscall_64"], "kernel: epoll"),
    (["__sys_socket", "__x64_sys_socket", "do_syscall_64"], "kernel: other system calls"),
    (["clear_page_erms", "do_anonymous_page", "exc_page_fault", "asm_exc_page_fault"], "kernel: page faults"),
    (["finish_task_switch.isra.0", "schedule", "irqentry_exit_to_user_mode"], "kernel: interrupts, scheduling"),
])  # fmt: skip
def test_a_kernel_sample_belongs_to_the_system_call_its_stack_is_under(frames: list[str], expected: str) -> None:
    assert category(Sample("1", tuple((f, KERNEL) for f in frames))) == expected


@pytest.mark.parametrize(("leaf", "dso", "expected"), [
    ("_PyEval_EvalFrameDefault", PY, "interpreter: bytecode"),
    ("_PyObject_Malloc", PY, "interpreter: allocation"),
    ("tupledealloc", PY, "interpreter: allocation"),
    ("gc_collect_main", PY, "garbage collector"),
    ("dict_traverse", PY, "garbage collector"),
    ("_Py_dict_lookup", PY, "interpreter: objects, calls, dicts"),
    ("__pyx_f_6uvloop_4loop_6Handle__run", UVLOOP, "uvloop and libuv"),
    ("llhttp__internal__run", "/x/httptools/parser/parser.cpython-311-x86_64-linux-gnu.so", "httptools"),
    ("[unknown]", "/x/orjson/orjson.cpython-311-x86_64-linux-gnu.so", "orjson"),
    ("BPE::word_to_tokens", "/x/tokenizers/tokenizers.abi3.so", "tokenizers"),
    ("_int_malloc", "/usr/lib/x86_64-linux-gnu/libc.so.6", "libc (malloc, memcpy) and vdso"),
    ("__vdso_clock_gettime", "[vdso]", "libc (malloc, memcpy) and vdso"),
    ("tokio::runtime::park", "/venv/bin/vllm-router", "other user code"),
])  # fmt: skip
def test_a_user_sample_belongs_to_the_library_of_its_leaf(leaf: str, dso: str, expected: str) -> None:
    assert user_category(leaf, dso) == expected


def test_a_split_counts_every_sample_once_and_names_the_leaves() -> None:
    found = split(samples(SCRIPT.splitlines()))
    assert found.total == 3 and set(found.by_category) <= set(CATEGORIES)
    assert found.share("kernel: write") == pytest.approx(1 / 3)
    assert found.share("garbage collector") == 0.0
    assert ("[kernel: write] _raw_spin_unlock_irqrestore", 1) in found.leaves


def test_perf_stat_counts_are_read_by_name_grouped_and_divided_per_unit() -> None:
    csv = ["# started on x", "", "120,,raw_syscalls:sys_enter,1000,100.00,,",
           "30,,syscalls:sys_enter_write,1000,100.00,,", "10,,syscalls:sys_enter_sendto,1000,100.00,,",
           "<not counted>,,syscalls:sys_enter_read,0,0.00,,", "7,,context-switches,1000,100.00,,"]
    counts = grouped(stat_counts(csv))
    assert counts["syscalls"] == 120 and counts["writes"] == 40 and "read" not in counts and "reads" not in counts
    per = per_unit(counts, 10, ["writes", "reads", "switches"])
    assert per["writes"] == 4.0 and per["switches"] == 0.7 and math.isnan(per["reads"])
