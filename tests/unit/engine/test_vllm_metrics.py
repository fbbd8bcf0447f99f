"""vLLM's /metrics text read by ``parse_metrics``: the series admission and the watchdog need, from any version
family, and whatever can be read from a partial or garbled page."""

from __future__ import annotations

import math
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from gateway.engine.vllm_api import EngineMetrics, parse_metrics
from gateway.engine.vllm_api import metrics as metrics_module
from gateway.engine.vllm_api.metrics import plain_sample

V1_TEXT = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 3.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny"} 1.0
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.25
vllm:num_preemptions_total{engine="0",model_name="tiny"} 9.0
vllm:num_preemptions_created{engine="0",model_name="tiny"} 1.7630000e+09
vllm:generation_tokens_total{engine="0",model_name="tiny"} 1234.0
vllm:cache_config_info{block_size="128",cache_dtype="auto",enable_prefix_caching="True",engine="0",\
gpu_memory_utilization="0.9",kv_cache_size_tokens="4096",num_cpu_blocks="None",num_gpu_blocks="32",\
num_gpu_blocks_override="None"} 1.0
python_gc_objects_collected_total{generation="0"} 123.0
"""

V0_TEXT = """\
vllm:cache_config_info{block_size="16",cache_dtype="auto",gpu_memory_utilization="0.9",num_cpu_blocks="2048",\
num_gpu_blocks="2000",sliding_window="None",swap_space_bytes="4294967296"} 1.0
vllm:num_requests_running{model_name="m"} 2.0
vllm:num_requests_swapped{model_name="m"} 0.0
vllm:num_requests_waiting{model_name="m"} 0.0
vllm:gpu_cache_usage_perc{model_name="m"} 0.5
vllm:num_preemptions_total{model_name="m"} 0.0
vllm:generation_tokens_total{model_name="m"} 10.0
"""

DISABLED_TEXT = """\
# HELP python_gc_objects_collected_total Objects collected during gc
python_gc_objects_collected_total{generation="0"} 1234.0
process_resident_memory_bytes 1.2e+09
"""

TWO_ENGINES = """\
vllm:num_requests_running{engine="0",model_name="m"} 2.0
vllm:num_requests_running{engine="1",model_name="m"} 5.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.1
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.7
vllm:num_preemptions_total{engine="0",model_name="m"} 1.0
vllm:num_preemptions_total{engine="1",model_name="m"} 2.0
vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="100"} 1.0
vllm:cache_config_info{block_size="16",engine="1",num_gpu_blocks="100"} 1.0
"""

NOTHING: dict[str, Any] = {
    "has_metrics": False, "kv_usage": None, "running": None, "waiting": None, "preemptions_total": None,
    "generation_tokens_total": None, "num_gpu_blocks": None, "block_size": None,
}


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (V1_TEXT, {"has_metrics": True, "kv_usage": 0.25, "running": 3, "waiting": 1, "preemptions_total": 9.0,
                   "generation_tokens_total": 1234.0, "num_gpu_blocks": 32, "block_size": 128}),
        (V0_TEXT, {"has_metrics": True, "kv_usage": 0.5, "running": 2, "waiting": 0, "preemptions_total": 0.0,
                   "generation_tokens_total": 10.0, "num_gpu_blocks": 2000, "block_size": 16}),
        (DISABLED_TEXT, NOTHING),
        ("", NOTHING),
        ("\x00\xff garbage {{{ \n<html>502 Bad Gateway</html>\n", NOTHING),
        (TWO_ENGINES, {**NOTHING, "has_metrics": True, "kv_usage": 0.7, "running": 7, "preemptions_total": 3.0,
                       "num_gpu_blocks": 100, "block_size": 16}),
    ],
    ids=["v1", "v0", "disable-log-stats", "empty", "garbage", "two-engines"],
)
def test_parse_reads_what_admission_needs(text: str, expected: dict[str, Any]) -> None:
    assert reading(parse_metrics(text)) == expected


@pytest.mark.parametrize(
    ("line", "key", "value"),
    [
        ('vllm:kv_cache_usage_perc{engine="0"} 0.3\nvllm:gpu_cache_usage_perc{engine="0"} 0.9', "kv_usage", 0.3),
        ('vllm:kv_cache_usage_perc{engine="0"} 42', "kv_usage", 0.42),  # percent, not a fraction
        ('vllm:kv_cache_usage_perc{engine="0"} NaN', "kv_usage", None),
        ("vllm:num_requests_running 4 1700000000000", "running", 4),  # with a timestamp, no labels
        ("vllm:num_requests_running{engine=\"0\"} not-a-number", "running", None),
        ('vllm:num_requests_running{engine="0"', "running", None),  # cut off mid-line
        ('vllm:cache_config_info{block_size="128",kv_cache_size_tokens="4096",num_gpu_blocks="None"} 1',
         "num_gpu_blocks", 32),
        ('vllm:cache_config_info{block_size="128",num_gpu_blocks="None"} 1', "num_gpu_blocks", None),
        ('vllm:cache_config_info{block_size="None",num_gpu_blocks="32"} 1', "num_gpu_blocks", None),
        ('vllm:cache_config_info{a="x \\" y",block_size="16",num_gpu_blocks="9"} 1', "num_gpu_blocks", 9),
    ],
)
def test_parse_is_tolerant_of_odd_lines(line: str, key: str, value: object) -> None:
    assert getattr(parse_metrics(line), key) == value


def reading(page: EngineMetrics) -> dict[str, Any]:
    fields = asdict(page)
    return {key: fields[key] for key in NOTHING}


@pytest.mark.parametrize(
    ("text", "key", "value"),
    [
        # A counter published without Prometheus' _total suffix.
        ('vllm:num_preemptions{engine="0"} 4\nvllm:num_preemptions{engine="1"} 1', "preemptions_total", 5.0),
        # Both spellings (V1 0.10-0.11): the current one only, not their sum.
        ('vllm:prefix_cache_hits_total{engine="0"} 7\nvllm:gpu_prefix_cache_hits_total{engine="0"} 7',
         "prefix_cache_hits_total", 7.0),
        ('vllm:request_success_total{finished_reason="stop"} 3\nvllm:request_success_total{finished_reason="length"} 2',
         "request_success_total", 5.0),
        ('vllm:num_requests_waiting_by_reason{reason="capacity"} 2\nvllm:num_requests_waiting 2',
         "waiting_by_reason", {"capacity": 2}),
        ('vllm:cache_config_info{block_size="16",enable_prefix_caching="False",num_gpu_blocks="9"} 1',
         "prefix_caching", False),
        ("vllm:num_preemptions_created 1.76e+09", "preemptions_total", None),
        ("vllm:num_preemptions_created 1.76e+09", "has_metrics", False),
    ],
)
def test_each_series_is_read_under_every_spelling(text: str, key: str, value: object) -> None:
    assert getattr(parse_metrics(text), key) == value


def test_one_garbled_line_loses_only_itself() -> None:
    text = V1_TEXT.replace('vllm:num_requests_waiting{engine="0",model_name="tiny"} 1.0', 'vllm:num_requests_waiting{')
    page = parse_metrics(text)
    assert (page.waiting, page.running, page.kv_usage, page.num_gpu_blocks) == (None, 3, 0.25, 32)


# -- the plain lines, read without the library's parser ------------------------------------------------
FIXTURES = Path(__file__).parents[2] / "fixtures" / "vllm"
PAGES = sorted(FIXTURES.glob("*/metrics.txt"))


def library_samples(line: str) -> list[Sample]:
    """prometheus_client's reading of one line: its samples, none when it refuses the line."""
    try:
        return [s for family in text_string_to_metric_families(line) for s in family.samples]
    except ValueError:
        return []


def same(a: Sample, b: Sample) -> bool:
    """Equal samples, the value of the same type (int or float), NaN equal to NaN."""
    values = a.value == b.value or (math.isnan(a.value) and math.isnan(b.value))
    return a._replace(value=0) == b._replace(value=0) and values and type(a.value) is type(b.value)


@pytest.mark.parametrize("page", PAGES, ids=[p.parent.name for p in PAGES])
def test_every_plain_line_of_vllms_pages_reads_as_the_library_reads_it(page: Path) -> None:
    lines = [line for line in page.read_text().splitlines() if line and not line.startswith("#")]
    plain = [(line, plain_sample(line)) for line in lines]
    assert sum(sample is not None for _, sample in plain) >= len(lines) * 0.9  # vLLM writes the plain shape
    for line, sample in plain:
        if sample is not None:
            (expected,) = library_samples(line)
            assert same(sample, expected), line


@pytest.mark.parametrize("page", PAGES, ids=[p.parent.name for p in PAGES])
def test_every_page_reads_as_with_the_library_alone(page: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    text = page.read_text()
    read = parse_metrics(text)
    monkeypatch.setattr(metrics_module, "plain_sample", lambda line: None)
    assert read == parse_metrics(text)


NAME = st.sampled_from(["vllm:num_requests_running", "vllm:x_total", "a", "_b:c", "9bad", "vllm:num-x", ""])
LABEL_NAME = st.sampled_from(["engine", "model_name", "le", "__name__", "reason", "a b", "9x", ""])
LABEL_VALUE = st.text(alphabet=st.sampled_from(list('abn0/._-:" \\{},=\té')), max_size=6)
NUMBER = st.sampled_from(["1", "1.0", "-2", "+3", "1e3", "1.5E-2", "NaN", "nan", "+Inf", "-Inf", "Inf", "1_0",
                          "0x10", "", "abc", "1.0 1700000000000", "1\t2", "1 # {a=\"b\"} 2", " 1", "1 "])


@st.composite
def sample_lines(draw: st.DrawFn) -> str:
    labels = draw(st.lists(st.tuples(LABEL_NAME, LABEL_VALUE), max_size=3))
    body = ",".join(f'{k}="{v}"' for k, v in labels) + draw(st.sampled_from(["", ",", ", "]))
    braces = draw(st.sampled_from(["{%s}", "{%s", "%s}", "", " {%s}"]))
    spaces = draw(st.sampled_from([" ", "  ", "\t"]))
    return draw(NAME) + (braces % body if "%s" in braces else braces) + spaces + draw(NUMBER)


@settings(max_examples=1500, deadline=None)
@given(sample_lines())
@example('vllm:x{a="b\\\\c"} 1')  # an escaped backslash: the library unescapes it
@example('vllm:x{a="b\\nc"} 1')  # an escaped newline
@example('vllm:x{a="b\\"c"} 1')  # an escaped quote
def test_a_line_read_plainly_reads_as_the_library_reads_it(line: str) -> None:
    """Whatever the plain reading takes, the library reads the same (one sample, equal, of the same type); the
    rest it leaves to the library."""
    sample = plain_sample(line)
    if sample is not None:
        found = library_samples(line)
        assert len(found) == 1 and same(sample, found[0]), (line, found)
