"""vLLM's log lines, command line and counters are read the same way across the versions users run."""

from __future__ import annotations

import logging

import pytest

from gateway.config import Settings
from gateway.managed.vllm_log import (
    AvailableKvMemory,
    BlockCounts,
    CudaOutOfMemory,
    EngineDead,
    FitStep,
    FragmentationHint,
    InsufficientFreeMemory,
    KvCacheSize,
    LogEvent,
    LogFacts,
    MaxConcurrency,
    MaxSeqLenTooLarge,
    NoCacheMemory,
    PlatformDetected,
    StartupFailure,
    Watchdog,
    arg_value,
    base_command,
    engine_args,
    engine_death_reply,
    log_level,
    parse_line,
    parse_progress,
    plan_autofit,
    redact,
    with_arg,
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


# -- command line ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("args", "name", "value"),
    [
        (["--max-model-len", "4096"], "--max-model-len", "4096"),
        (["--max-model-len=4096"], "--max-model-len", "4096"),
        (["--max_model_len", "4096"], "--max-model-len", "4096"),
        (["--max-model-len", "1", "--max-model-len", "2"], "--max-model-len", "2"),
        (["--dtype", "float32"], "--max-model-len", None),
        (["--max-model-len"], "--max-model-len", None),
    ],
)
def test_arg_value_reads_every_spelling_vllm_accepts(args: list[str], name: str, value: str | None) -> None:
    assert arg_value(args, name) == value


@pytest.mark.parametrize(
    "args",
    [["--max-model-len", "32768", "--dtype", "float32"], ["--max_model_len=32768", "--dtype", "float32"]],
)
def test_with_arg_replaces_the_old_value(args: list[str]) -> None:
    assert with_arg(args, "--max-model-len", "3968") == ["--dtype", "float32", "--max-model-len", "3968"]


def test_redact_hides_api_keys() -> None:
    assert redact(["vllm", "--api-key", "sk-1", "--api-key=sk-2"]) == ["vllm", "--api-key", "***", "--api-key=***"]


@pytest.mark.parametrize(
    ("command", "script", "expected"),
    [
        (None, "/venv/bin/vllm", ["/venv/bin/vllm", "serve", "m"]),
        ("/other/bin/python3.11", None, ["/other/bin/python3.11", "-m", "vllm.entrypoints.openai.api_server",
                                         "--model", "m"]),
        ("/other/bin/vllm serve", None, ["/other/bin/vllm", "serve", "m"]),
        ("docker-run-vllm --x {model}", None, ["docker-run-vllm", "--x", "m"]),
        ("python fake.py --fake-scenario ok", None, ["python", "fake.py", "--fake-scenario", "ok", "--model", "m"]),
    ],
)
def test_base_command_follows_the_override_or_the_detected_script(
    command: str | None, script: str | None, expected: list[str]
) -> None:
    settings = Settings.model_validate({"managed": True, "model": "m", "vllm_command": command})
    assert base_command(settings, script) == expected


@pytest.mark.parametrize(
    ("values", "overrides", "expected"),
    [
        ({}, {}, ["--host", "127.0.0.1", "--port", "9000"]),
        (
            {"vllm_args": ["--dtype", "float32", "--port", "1"], "served_model_name": "tiny", "max_model_len": 4096,
             "upstream_api_key": "sk-up"},
            {},
            ["--dtype", "float32", "--served-model-name", "tiny", "--api-key", "sk-up", "--max-model-len", "4096",
             "--host", "127.0.0.1", "--port", "9000"],
        ),
        (
            {"vllm_args": ["--max-model-len", "32768", "--served-model-name", "mine"], "served_model_name": "tiny"},
            {"--max-model-len": "3968"},
            ["--served-model-name", "mine", "--max-model-len", "3968", "--host", "127.0.0.1", "--port", "9000"],
        ),
    ],
)
def test_engine_args_add_the_gateways_settings_the_autofit_and_the_private_address(
    values: dict[str, object], overrides: dict[str, str], expected: list[str]
) -> None:
    settings = Settings.model_validate({"managed": True, "model": "m", **values})
    assert engine_args(settings, overrides, 9000) == expected


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


def test_without_a_working_script_vllm_starts_through_this_python() -> None:
    import sys

    settings = Settings.model_validate({"managed": True, "model": "m"})
    assert base_command(settings, None) == [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", "m"]


# -- auto-fit -------------------------------------------------------------------------------------
FITS: list[tuple[str, StartupFailure | None, list[str], str | None, dict[str, str] | None]] = [
    ("V1 estimate on CPU", MaxSeqLenTooLarge(32768, estimated_max_len=3968), [], "CPU", {"--max-model-len": "3968"}),
    ("V1 estimate rounded to 16", MaxSeqLenTooLarge(131072, estimated_max_len=79475), [], "GPU",
     {"--max-model-len": "79472"}),
    ("block size from the args", MaxSeqLenTooLarge(32768, estimated_max_len=3999), ["--block-size", "32"], "GPU",
     {"--max-model-len": "3968"}),
    ("V0 token count", MaxSeqLenTooLarge(32768, kv_tokens=20544), [], None, {"--max-model-len": "20544"}),
    ("no estimate", MaxSeqLenTooLarge(8192), [], "GPU", None),
    ("estimate below one block", MaxSeqLenTooLarge(8192, estimated_max_len=100), [], "CPU", None),
    ("estimate not below the current value", MaxSeqLenTooLarge(4096, estimated_max_len=8000),
     ["--max-model-len", "4096"], "GPU", None),
    ("no cache memory, default", NoCacheMemory(), [], None, {"--gpu-memory-utilization": "0.93"}),
    ("no cache memory, stepped", NoCacheMemory(), ["--gpu-memory-utilization", "0.93"], None,
     {"--gpu-memory-utilization": "0.95"}),
    ("no cache memory, at the top", NoCacheMemory(), ["--gpu-memory-utilization=0.95"], None, None),
    ("no cache memory, fixed size", NoCacheMemory(), ["--kv-cache-memory-bytes", "1000"], None, None),
    ("free memory", InsufficientFreeMemory("cuda:0", 10.5, 79.19, 0.9, 71.27), [], "GPU", None),
    ("out of memory", CudaOutOfMemory(20.0, None, False), [], "GPU", None),
    ("unknown failure", None, [], None, None),
]


@pytest.mark.parametrize(("case", "failure", "args", "device", "changes"), FITS, ids=[c[0] for c in FITS])
def test_autofit_acts_on_vllms_numbers_or_gives_up(
    case: str, failure: StartupFailure | None, args: list[str], device: str | None, changes: dict[str, str] | None
) -> None:
    step = plan_autofit(failure, args, device)
    if changes is None:
        assert isinstance(step, str) and step
    else:
        assert isinstance(step, FitStep)
        assert step.changes == changes
        assert all(v in step.reason for v in changes.values())


def test_giving_up_on_free_memory_names_the_processes_holding_it() -> None:
    step = plan_autofit(
        InsufficientFreeMemory("cuda:0", 10.5, 79.19, 0.9, 71.27), [], "GPU",
        ["pid 4242 VLLM::EngineCore on GPU 0: 60000 MiB"],
    )
    assert isinstance(step, str)
    assert "pid 4242 VLLM::EngineCore" in step and "10.5/79.19 GiB" in step


# -- watchdog -------------------------------------------------------------------------------------
def dog(**kw: float) -> Watchdog:
    opts: dict[str, float] = {"hang_timeout": 10.0, "growth_mib": 1000.0, "storm": 50} | kw
    return Watchdog(0.0, hang_timeout=opts["hang_timeout"], growth_mib=opts["growth_mib"], storm=int(opts["storm"]))


@pytest.mark.parametrize(
    ("health", "reason"),
    [
        ([(1, True), (5, False), (10, False)], None),  # silent 5 s of 10
        ([(1, True), (5, False), (11, False)], "hang"),
        ([(5, False), (9, True), (15, False)], None),  # an answer in between resets the clock
    ],
)
def test_health_that_stays_silent_for_the_hang_timeout_is_a_hang(
    health: list[tuple[float, bool]], reason: str | None
) -> None:
    d = dog()
    results = [d.observe_health(t, ok) for t, ok in health]
    assert (results[-1].reason if results[-1] else None) == reason
    assert all(r is None for r in results[:-1])


@pytest.mark.parametrize(
    ("samples", "reason"),
    [
        ([(0, 2, 100), (5, 2, 100), (10, 2, 100)], "hang"),  # requests running, no token for 10 s
        ([(0, 2, 100), (5, 2, 150), (10, 2, 150)], None),  # progress at 5 s
        ([(0, 0, 100), (5, 0, 100), (12, 0, 100)], None),  # idle is not a hang
        ([(0, 0, 100), (5, 1, 100), (14, 1, 100)], None),  # running for only 9 s
        ([(0, None, None), (20, None, None)], None),  # metrics unknown: only /health decides
    ],
)
def test_running_requests_without_generated_tokens_are_a_hang(
    samples: list[tuple[float, float | None, float | None]], reason: str | None
) -> None:
    d = dog()
    results = [d.observe_engine(t, running, tokens, None) for t, running, tokens in samples]
    assert (results[-1].reason if results[-1] else None) == reason
    assert all(r is None for r in results[:-1])


@pytest.mark.parametrize(
    ("samples", "reason"),
    [
        ([(0, 0), (30, 20), (59, 50)], "preemption_storm"),
        ([(0, 0), (30, 30), (65, 60), (95, 70)], None),  # 60 in 65 s, but never 50 within a minute
        ([(0, 100), (10, 3), (20, 40)], None),  # a restarted engine counts from zero
    ],
)
def test_many_preemptions_within_a_minute_are_a_storm(samples: list[tuple[float, float]], reason: str | None) -> None:
    d = dog()
    results = [d.observe_engine(t, 1, t, p) for t, p in samples]
    assert (results[-1].reason if results[-1] else None) == reason


@pytest.mark.parametrize(
    ("readings", "growth", "reason"),
    [
        ([20000, 20500, 21000], 1000, "memory_growth"),
        ([20000, 20500, 20999], 1000, None),
        ([None, 20000, 30000], 0, None),  # 0 turns the check off
        ([None, None], 1000, None),
    ],
)
def test_gpu_memory_growing_past_its_baseline_is_fragmentation(
    readings: list[float | None], growth: float, reason: str | None
) -> None:
    d = dog(growth_mib=growth)
    results = [d.observe_memory(mib) for mib in readings]
    assert (results[-1].reason if results[-1] else None) == reason


def test_progress_is_summed_over_engines_from_vllms_metrics() -> None:
    text = (
        "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
        "# TYPE vllm:num_requests_running gauge\n"
        'vllm:num_requests_running{engine="0",model_name="m"} 2.0\n'
        'vllm:num_requests_running{engine="1",model_name="m"} 1.0\n'
        'vllm:generation_tokens_total{engine="0",model_name="m"} 1234.0\n'
        'vllm:num_preemptions_total{engine="0",model_name="m"} 7.0\n'
        'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5\n'
    )
    assert parse_progress(text) == (3.0, 1234.0, 7.0)
    assert parse_progress("") == (None, None, None)
