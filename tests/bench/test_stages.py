"""The stages benchmark assigns each sampled stack of the gateway to one stage of a request's path."""

from __future__ import annotations

import pytest

from bench.workloads.stages import BACKGROUND, LOOP, ORDER, OTHER_THREADS, shares, split_cpu, stage_of

ROOT = ["thread (0x7f): MainThread", "<module> (gateway/cli.py:154)", "Server.run (uvicorn/server.py:86)",
        "Runner.run (asyncio/runners.py:118)"]
HTTP = [*ROOT, "RequestResponseCycle.run_asgi (uvicorn/protocols/http/httptools_impl.py:422)",
        "GuardedFastPath._guarded (gateway/http/app.py:115)", "serve_guarded (gateway/http/relay.py:40)",
        "_serve (gateway/http/relay.py:71)"]
PIPELINE = [*HTTP, "handle (gateway/guard/pipeline.py:69)"]
ADMIT = [*PIPELINE, "admit_and_exchange (gateway/guard/pipeline.py:150)"]


@pytest.mark.parametrize(("frames", "stage"), [
    (ROOT, LOOP),
    ([*ROOT, "Periodic._loop (gateway/periodic.py:100)", "EngineView.refresh (gateway/engine/live.py:120)",
      "ModelList.max_model_len (gateway/engine/x.py:3)"], BACKGROUND),
    ([*PIPELINE, "run (gateway/guard/offload.py:61)", "parse_chat (gateway/guard/endpoints/chat.py:20)"],
     "parse and validate"),
    ([*PIPELINE, "plan_generation (gateway/guard/planning.py:30)", "Booking.__init__ (<string>:2)"],
     "count and plan"),
    ([*ADMIT, "Grant._admit (gateway/tenants/grant.py:40)", "Admission.enter (gateway/admission/controller.py:9)"],
     "admission: reserve and release"),
    ([*ADMIT, "exchange_with_engine (gateway/guard/exchange.py:60)", "Upstream.open (gateway/engine/client.py:5)"],
     "exchange with the engine"),
    ([*PIPELINE, "dumps (gateway/guard/offload.py:84)"], "the engine's body"),
    ([*ROOT, "LocalCounter._run (gateway/guard/counting/local.py:90)", "render (jinja2/environment.py:1)"],
     "count and plan"),
    ([*ROOT, "Connection.data_received (gateway/engine/wire.py:192)"], "exchange with the engine"),
    ([*ROOT, "Admission._pump (gateway/admission/controller.py:300)"], "admission: reserve and release"),
    ([*HTTP, "AccessEntry.finish (gateway/http/access.py:50)"], "access log"),
    ([*HTTP, "read_context (gateway/http/context.py:35)"], "read the request"),
    ([*HTTP, "Response.__call__ (starlette/responses.py:160)"], "write the answer"),
    ([*ROOT, "GuardProtocol.data_received (gateway/http/server_protocol.py:50)"], "HTTP server"),
])  # fmt: skip
def test_a_sample_on_the_loop_belongs_to_the_stage_its_frames_name(frames: list[str], stage: str) -> None:
    assert stage_of(frames, loop_thread=True) == stage


@pytest.mark.parametrize(("frames", "stage"), [
    (["thread (7): MainThread", "thread", "Upstream.open (gateway/engine/client.py:5)"], "exchange with the engine"),
    (["thread (7): MainThread", "Response.__call__ (starlette/responses.py:160)"], "write the answer"),
    (["thread (7): MainThread", "thread"], LOOP),
])  # fmt: skip
def test_a_stack_read_truncated_at_its_root_is_placed_by_the_frames_it_kept(frames: list[str], stage: str) -> None:
    assert stage_of(frames, loop_thread=True) == stage
    assert shares([";".join(frames) + " 1"])[stage] == 1.0


def test_a_sample_of_another_thread_is_counted_off_the_loop() -> None:
    assert stage_of(["thread (0x1)", "_worker (concurrent/futures/thread.py:81)"], loop_thread=False) == OTHER_THREADS


def test_the_shares_of_a_raw_profile_add_up_to_one_in_the_paths_order() -> None:
    raw = [";".join(ROOT) + " 6", ";".join([*PIPELINE, "dumps (gateway/guard/offload.py:84)"]) + " 2",
           "thread (0x2): access-log;_worker (concurrent/futures/thread.py:81) 2", "", "garbage"]
    got = shares(raw)
    assert list(got) == list(ORDER)
    assert (got[LOOP], got["the engine's body"], got[OTHER_THREADS]) == (0.6, 0.2, 0.2)
    assert shares([]) == {}


def test_the_loop_thread_s_wait_for_a_core_is_taken_out_of_the_event_loop_not_spread_over_the_stages() -> None:
    # 1,000 chats; the loop thread ran 0.8 s and waited 0.3 s for a core, its samples (which count the wait as
    # work) half the event loop's, half counting; the process spent 0.9 s in all (0.1 s in other threads).
    got = split_cpu({LOOP: 0.45, "count and plan": 0.45, OTHER_THREADS: 0.1}, ran_s=0.8, waited_s=0.3, cpu_s=0.9,
                    units=1000)
    assert got["count and plan"] == pytest.approx(550)  # half of the 1,100 us a chat run and waited
    assert got[LOOP] == pytest.approx(250)  # 550 less the 300 us waited
    assert got[OTHER_THREADS] == pytest.approx(100)
    assert sum(got.values()) == pytest.approx(900)  # the process's CPU per chat, all told


def test_a_wait_larger_than_the_event_loop_s_samples_leaves_it_at_zero() -> None:
    got = split_cpu({LOOP: 0.1, "HTTP server": 0.9}, ran_s=0.5, waited_s=0.5, cpu_s=0.5, units=100)
    assert got[LOOP] == 0.0 and got["HTTP server"] == pytest.approx(9000)
    assert split_cpu({LOOP: 1.0}, 0.1, 0.1, 0.1, units=0) == {}
