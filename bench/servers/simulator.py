"""The vLLM simulator of the test suite (testing/vllm_sim/) as a server of its own, for benchmarks.

    python -m bench.servers.simulator --port 8000 [--token-delay 0.02] [--num-blocks 1000000] [--tokenizer DIR]

Slower than ``bench.servers.fake_engine`` (a Starlette app that schedules blocks as vLLM does), but it keeps a KV
cache, counts prompts with a real tokenizer when given one and ends answers where a request's ``min_tokens`` and
EOS bias say.
"""

from __future__ import annotations

import argparse
import gc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--tokenizer", default=None, help="a tokenizer directory: prompts counted, root set to it")
    parser.add_argument("--max-model-len", type=int, default=32768)
    parser.add_argument("--num-blocks", type=int, default=1_000_000)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=100_000)
    parser.add_argument("--token-delay", type=float, default=0.0)
    args = parser.parse_args(argv)

    import uvicorn

    from testing.vllm_sim import SimConfig, create_sim_app

    tokenizer = None
    if args.tokenizer:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    app = create_sim_app(SimConfig(model=args.model, root=args.tokenizer, tokenizer=tokenizer,
                                   max_model_len=args.max_model_len, num_blocks=args.num_blocks,
                                   block_size=args.block_size, max_num_seqs=args.max_num_seqs,
                                   token_delay=args.token_delay))  # fmt: skip
    gc.collect()
    gc.freeze()  # as the gateway does: an engine alone must not carry GC pauses the gateway avoids
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", access_log=False, loop="uvloop",
                http="httptools")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
