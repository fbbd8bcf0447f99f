"""vLLM's log lines are read as the same facts across the versions users run, and relayed at their own level."""

from __future__ import annotations

import logging

import pytest

from gateway.managed.logfacts import (
    AvailableKvMemory,
    BlockCounts,
    CudaOutOfMemory,
    EngineDead,
    FragmentationHint,
    InsufficientFreeMemory,
    KvCacheSize,
    LogEvent,
    LogFacts,
    MaxConcurrency,
    MaxSeqLenTooLarge,
    NoCacheMemory,
    PlatformDetected,
    engine_death_reply,
    log_level,
    parse_line,
)

V1_032 = (
    "ValueError: To serve at least one request with the model's max seq len (32768), (0.03 GiB KV cache is "
    "needed, which is larger than the available KV cache memory (0.0 GiB). Based on the available memory, the "
    "estimated maximum model length is 3968. Try increasing `gpu_memory_utilization` (which also controls CPU "
    "memory on the CPU backend) or decreasing `max_model_len` when initializing the engine. See "
    "https://docs.vllm.ai/en/latest/configuration/conserving_memory/ for more details."
)
V1_010 = (
    "(EngineCore_0 pid=311) ValueError: To serve at least one request with the models's max seq len (131072), "
    "(16.00 GiB KV cache is needed, which is larger than the available KV cache memory (9.71 GiB). Based on "
    "the available memory, the estimated maximum model length is 79472. Try increasing "
    "`gpu_memory_utilization` or decreasing `max_model_len` when initializing the engine."
)
V1_NO_ESTIMATE = (
    "ValueError: To serve at least one request with the models's max seq len (8192), (1.00 GiB KV cache is "
    "needed, which is larger than the available KV cache memory (0.01 GiB). Try increasing "
    "`gpu_memory_utilization` or decreasing `max_model_len` when initializing the engine."
)
V0 = (
    "ValueError: The model's max seq len (32768) is larger than the maximum number of tokens that can be "
    "stored in KV cache (20544). Try increasing `gpu_memory_utilization` or decreasing `max_model_len` when "
    "initializing the engine."
)
OOM_NEW = (
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of "
    "79.15 GiB of which 2.81 MiB is free. Including non-PyTorch memory, this process has 79.14 GiB memory in "
    "use. Of the allocated memory 77.86 GiB is allocated by PyTorch, and 773.13 MiB is reserved by PyTorch but "
    "unallocated. If reserved but unallocated memory is large try setting "
    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation for Memory "
    "Management  (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"
)
OOM_OLD = (
    "RuntimeError: CUDA out of memory. Tried to allocate 1.50 GiB (GPU 0; 15.78 GiB total capacity; 14.56 GiB "
    "already allocated; 4.75 MiB free; 14.61 GiB reserved in total by PyTorch) If reserved memory is >> "
    "allocated memory try setting max_split_size_mb to avoid fragmentation."
)

LINES: list[tuple[str, str, list[LogEvent]]] = [
    (
        "0.30+ CPU, one line",
        "INFO 11-21 12:00:01 [kv_cache_utils.py:1087] CPU KV cache size: 4,096 tokens, Maximum concurrency "
        "for 2,048 tokens per request: 2.00x",
        [KvCacheSize("CPU", 4096), MaxConcurrency(2048, 2.0)],
    ),
    (
        "0.28 GPU from the engine core",
        "(EngineCore_DP0 pid=1234) INFO 09-01 10:00:00 [kv_cache_utils.py:1087] GPU KV cache size: 1,048,576 "
        "tokens, Maximum concurrency for 32,768 tokens per request: 32.00x",
        [KvCacheSize("GPU", 1_048_576), MaxConcurrency(32768, 32.0)],
    ),
    (
        "0.27 and older, size line",
        "INFO 05-01 10:00:00 [kv_cache_utils.py:634] GPU KV cache size: 215,632 tokens",
        [KvCacheSize("GPU", 215_632)],
    ),
    (
        "0.27 and older, concurrency line",
        "INFO 05-01 10:00:00 [kv_cache_utils.py:637] Maximum concurrency for 8,192 tokens per request: 26.32x",
        [MaxConcurrency(8192, 26.32)],
    ),
    (
        "0.8 V1 without separators",
        "INFO 04-30 10:00:00 [kv_cache_utils.py:566] GPU KV cache size: 90000 tokens",
        [KvCacheSize("GPU", 90000)],
    ),
    (
        "V0 GPU blocks",
        "INFO 01-10 10:00:00 worker.py:249] # GPU blocks: 27153, # CPU blocks: 2048",
        [BlockCounts("GPU", 27153, 2048)],
    ),
    (
        "0.7 cuda blocks",
        "INFO 01-10 10:00:00 executor_base.py:110] # cuda blocks: 5000, # CPU blocks: 512",
        [BlockCounts("GPU", 5000, 512)],
    ),
    ("V0 CPU backend", "INFO 01-10 10:00:00 cpu_executor.py:186] # CPU blocks: 2048", [BlockCounts("CPU", 2048, None)]),
    (
        "available KV memory",
        "INFO 07-01 10:00:00 [gpu_worker.py:298] Available KV cache memory: 58.91 GiB",
        [AvailableKvMemory(58.91)],
    ),
    (
        "platform",
        "INFO 11-21 12:00:00 [__init__.py:291] Automatically detected platform cpu.",
        [PlatformDetected("cpu")],
    ),
    ("V1 error, 0.32", V1_032, [MaxSeqLenTooLarge(32768, estimated_max_len=3968, needed_gib=0.03, available_gib=0.0)]),
    (
        "V1 error, 0.10 spelling",
        V1_010,
        [MaxSeqLenTooLarge(131072, estimated_max_len=79472, needed_gib=16.0, available_gib=9.71)],
    ),
    ("V1 error, no estimate", V1_NO_ESTIMATE, [MaxSeqLenTooLarge(8192, needed_gib=1.0, available_gib=0.01)]),
    ("V0 error", V0, [MaxSeqLenTooLarge(32768, kv_tokens=20544)]),
    (
        "no cache memory",
        "ValueError: No available memory for the cache blocks. Try increasing `gpu_memory_utilization` when "
        "initializing the engine.",
        [NoCacheMemory()],
    ),
    (
        "free memory, 0.11+",
        "ValueError: Free memory on device cuda:0 (10.5/79.19 GiB) on startup is less than desired GPU memory "
        "utilization (0.9, 71.27 GiB). Decrease GPU memory utilization or reduce GPU memory used by other "
        "processes.",
        [InsufficientFreeMemory("cuda:0", 10.5, 79.19, 0.9, 71.27)],
    ),
    (
        "free memory, 0.8",
        "ValueError: Free memory on device (10.2/79.1 GiB) on startup is less than desired GPU memory "
        "utilization (0.9, 71.19 GiB). Decrease GPU memory utilization or reduce GPU memory used by other "
        "processes.",
        [InsufficientFreeMemory(None, 10.2, 79.1, 0.9, 71.19)],
    ),
    (
        "CPU memory, 0.32",
        "ValueError: Available memory on node 0 (1.2/15.5 GiB) on startup is less than desired CPU memory "
        "utilization (0.9, 13.95 GiB). On the CPU backend, the `--gpu-memory-utilization` flag controls ...",
        [InsufficientFreeMemory("0", 1.2, 15.5, 0.9, 13.95, cpu=True)],
    ),
    ("CUDA OOM, PyTorch 2.4+", OOM_NEW, [CudaOutOfMemory(20.0, 773.13, True)]),
    ("CUDA OOM, PyTorch 1.x", OOM_OLD, [CudaOutOfMemory(1536.0, None, True)]),
    (
        "fragmentation hint alone",
        "If reserved but unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
        [FragmentationHint(None)],
    ),
    (
        "engine died, 0.32",
        "(APIServer pid=1) ERROR 11-21 12:52:11 [async_llm.py:906] vllm.v1.engine.exceptions.EngineDeadError: "
        "EngineCore encountered an issue. See stack trace (above) for the root cause.",
        [EngineDead("(APIServer pid=1) ERROR 11-21 12:52:11 [async_llm.py:906] vllm.v1.engine.exceptions."
                    "EngineDeadError: EngineCore encountered an issue. See stack trace (above) for the root cause.")],
    ),
    (
        "worker died",
        "ERROR [multiproc_executor.py:316] Worker proc VllmWorker-1 died unexpectedly (exit code: -9), shutting down",
        [EngineDead("ERROR [multiproc_executor.py:316] Worker proc VllmWorker-1 died unexpectedly (exit code: -9), "
                    "shutting down")],
    ),
    ("noise", "INFO 11-21 12:00:05 [api_server.py:1000] Starting vLLM API server 0 on http://127.0.0.1:8000", []),
    ("KV words without numbers", "WARNING prefix caching of the KV cache is disabled", []),
]


@pytest.mark.parametrize(("version", "line", "events"), LINES, ids=[c[0] for c in LINES])
def test_each_log_line_yields_exactly_its_facts(version: str, line: str, events: list[LogEvent]) -> None:
    assert parse_line(line) == events


def fed(*lines: str) -> LogFacts:
    facts = LogFacts()
    for line in lines:
        facts.feed(line)
    return facts


CAPACITY: list[tuple[str, LogFacts, int | None, tuple[int, int] | None]] = [
    (
        "CPU line, CPU default block size",
        fed("CPU KV cache size: 4,096 tokens, Maximum concurrency for 2,048 tokens per request: 2.00x"),
        None,
        (4096, 32),
    ),
    ("GPU line, GPU default block size", fed("GPU KV cache size: 215,632 tokens"), None, (215_632, 13477)),
    ("explicit block size", fed("GPU KV cache size: 215,632 tokens"), 32, (215_632, 6738)),
    ("V0 blocks", fed("# GPU blocks: 27153, # CPU blocks: 2048"), None, (27153 * 16, 27153)),
    (
        "platform line sets the device",
        fed("Automatically detected platform cpu.", "# CPU blocks: 64"),
        None,
        (64 * 128, 64),
    ),
    ("nothing said", fed("Starting vLLM API server"), None, None),
]


@pytest.mark.parametrize(("case", "facts", "block_size", "expected"), CAPACITY, ids=[c[0] for c in CAPACITY])
def test_capacity_comes_from_the_log_in_tokens_and_blocks(
    case: str, facts: LogFacts, block_size: int | None, expected: tuple[int, int] | None
) -> None:
    assert facts.capacity(block_size) == expected


def test_facts_keep_the_max_model_len_and_the_last_failure() -> None:
    facts = fed(
        "CPU KV cache size: 4,096 tokens, Maximum concurrency for 2,048 tokens per request: 2.00x",
        "Traceback (most recent call last):",
        V1_032,
    )
    assert facts.max_model_len == 2048
    assert facts.device == "CPU"
    assert facts.failure == MaxSeqLenTooLarge(32768, estimated_max_len=3968, needed_gib=0.03, available_gib=0.0)


def test_a_hint_on_the_next_line_is_folded_into_the_out_of_memory_error() -> None:
    facts = fed(
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB.",
        "1.50 GiB is reserved by PyTorch but unallocated. If reserved but unallocated memory is large try ...",
    )
    assert facts.oom == CudaOutOfMemory(2048.0, 1536.0, True)
    assert facts.failure == facts.oom


@pytest.mark.parametrize(
    ("line", "level"),
    [
        ("(APIServer pid=1) WARNING 11-21 13:08:54 [cpu.py:224] Triton is not installed.", logging.WARNING),
        ("(EngineCore pid=2) ERROR 11-21 12:52:11 [core.py:1] EngineCore failed to start.", logging.ERROR),
        ("Traceback (most recent call last):", logging.INFO),
        ('(APIServer pid=1) INFO:     127.0.0.1:5 - "GET /metrics HTTP/1.1" 200 OK', logging.DEBUG),
        ('(APIServer pid=1) INFO:     127.0.0.1:5 - "POST /v1/completions HTTP/1.1" 200 OK', logging.INFO),
    ],
)
def test_vllms_lines_are_relayed_at_their_own_level_and_probes_quietly(line: str, level: int) -> None:
    assert log_level(line) == level


@pytest.mark.parametrize(
    ("message", "dead"),
    [
        ("EngineCore encountered an issue. See stack trace (above) for the root cause.", True),
        ("vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue.", True),
        ("Background loop has errored already.", True),
        ("This model's maximum context length is 2048 tokens.", False),
        ("Internal Server Error", False),
    ],
)
def test_an_engine_death_is_told_apart_from_other_server_errors(message: str, dead: bool) -> None:
    assert engine_death_reply(message) is dead
