"""A tiny random-weight Llama with a real byte-level BPE tokenizer and chat template, built locally.

The test suites and the GPU-less demo need a model that a real vLLM (the CPU build) can load, but nothing
may be downloaded. This module builds one from scratch, deterministically, in a second or two:

- a byte-level BPE tokenizer trained with ``tokenizers`` on a fixed built-in corpus, saved through
  ``transformers`` with BOS/EOS/PAD special tokens and a ChatML-like chat template (system, user,
  assistant and tool roles, ``tools``, ``documents``, string or text-part content, tool calls,
  ``add_generation_prompt``, ``continue_final_message``, an ``enable_thinking`` switch);
- a ``LlamaConfig`` sized for vLLM's CPU attention kernels (head_dim 64);
- random weights in ``model.safetensors``, written with numpy so neither torch nor a model class is needed.

``python -m gateway.tools.tinymodel OUT_DIR [--context 2048] [--no-weights]`` builds one and prints its path.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

# Bump whenever the output of a build changes, so stamped directories from older builds are rebuilt.
BUILDER_VERSION = 1
STAMP_FILE = ".tinymodel-build.json"
TOKENIZER_STAMP_FILE = ".tinymodel-tokenizer.json"

BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
PAD_TOKEN = "<pad>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
# Order fixes the ids: 0..4, ahead of the 256 byte symbols and the merges.
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, IM_START, IM_END)

HIDDEN_SIZE = 128
INTERMEDIATE_SIZE = 256
NUM_LAYERS = 2
NUM_HEADS = 2
NUM_KV_HEADS = 1
HEAD_DIM = HIDDEN_SIZE // NUM_HEADS  # 64: the CPU attention kernels refuse 16
VOCAB_SIZE = 512

# ChatML with Qwen-style tools. Content may be a string or a list of {"type": "text"} parts; the
# macro iterating over parts makes vLLM pass content in its "openai" format. Message text is rendered
# verbatim (no trimming) so that continue_final_message can find the final message in the output.
CHAT_TEMPLATE = (
    "{%- macro render_content(content) -%}"
    "{%- if content is string -%}{{ content }}"
    "{%- elif content is not none -%}"
    "{%- for part in content -%}"
    "{%- if part is string -%}{{ part }}"
    "{%- elif part['type'] == 'text' -%}{{ part['text'] }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{%- endmacro -%}"
    "{{- bos_token -}}"
    "{%- set ns = namespace(system_done=false) -%}"
    "{%- if tools or documents -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{{- render_content(messages[0]['content']) + '\\n\\n' -}}"
    "{%- set ns.system_done = true -%}"
    "{%- endif -%}"
    "{%- if tools -%}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n<tools>' -}}"
    "{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}"
    '{{- \'\\n</tools>\\nFor each call, answer with <tool_call>{"name": ..., "arguments": ...}'
    "</tool_call>.' -}}"
    "{%- endif -%}"
    "{%- if documents -%}"
    "{{- '\\n# Documents\\n' -}}"
    "{%- for doc in documents -%}"
    "{{- '\\n## ' + (doc['title'] | default('Document ' ~ loop.index)) + '\\n' + doc['text'] -}}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}"
    "{%- if not (loop.first and ns.system_done) -%}"
    "{{- '<|im_start|>system\\n' + render_content(message['content']) + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- elif message['role'] == 'user' -%}"
    "{{- '<|im_start|>user\\n' + render_content(message['content']) + '<|im_end|>\\n' -}}"
    "{%- elif message['role'] == 'assistant' -%}"
    "{{- '<|im_start|>assistant\\n' + render_content(message['content']) -}}"
    "{%- if message['tool_calls'] is defined and message['tool_calls'] -%}"
    "{%- for call in message['tool_calls'] -%}"
    "{%- set fn = call['function'] if call['function'] is defined else call -%}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + fn['name'] + '\", \"arguments\": ' -}}"
    "{{- (fn['arguments'] if fn['arguments'] is string else (fn['arguments'] | tojson)) + '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- elif message['role'] == 'tool' -%}"
    "{{- '<|im_start|>tool\\n<tool_response>\\n' + render_content(message['content'])"
    " + '\\n</tool_response><|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- raise_exception('Unknown message role: ' + message['role']"
    " + ' (expected system, user, assistant or tool)') -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}"
    "{{- '<think>\\n\\n</think>\\n\\n' -}}"
    "{%- endif -%}"
    "{%- endif -%}"
)

# Varied text so that the merges cover prose, code, JSON, numbers and the chat markup itself.
_CORPUS = """\
The quick brown fox jumps over the lazy dog. A gateway counts tokens before it forwards a request.
When the prompt is longer than the context, the server answers with an error instead of wasting work.
Large language models read text as tokens; a token is a piece of a word, a whole word, or punctuation.
The scheduler keeps a cache of keys and values for every running sequence, one block at a time.
If too many sequences run at once, the cache fills up and the engine has to preempt some of them.
Please summarize the following document in three sentences, and list the main points as bullets.
What is the capital of France? The capital of France is Paris. What is the weather like today?
It is sunny with a light breeze, and the temperature is twenty-one degrees Celsius in the afternoon.
user assistant system tool function arguments name content role messages tools documents title text
You are a helpful assistant. Answer briefly and precisely. Think step by step before you answer.
def count_tokens(text: str) -> int:
    return len(tokenizer.encode(text))

for i in range(10):
    print(f"value {i}: {i * i}")

class Request:
    def __init__(self, prompt, max_tokens=16):
        self.prompt = prompt
        self.max_tokens = max_tokens
{"model": "tiny", "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 32, "stream": true}
{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}, "type": "function"}
<tool_call>{"name": "search", "arguments": {"query": "vLLM KV cache"}}</tool_call>
<tool_response>{"results": [1, 2, 3], "ok": true}</tool_response>
0 1 2 3 4 5 6 7 8 9 10 11 12 16 32 64 100 128 256 512 1000 1024 2048 4096 8192 16384 32768 65536
3.14159 2.71828 1,024 tokens 99% 50/50 #1 @home $20 (a+b)*c [x] {y} <z> a_b a-b a.b a:b a;b a!b a?b
Der schnelle braune Fuchs springt. Le renard brun saute. El zorro marrón salta. Быстрая лиса. 速い狐。
Once upon a time there was a small model that lived on a machine without a graphics card.
It could not say anything clever, but it always answered, and it never ran out of memory.
"""

_SYLLABLES = (
    "ka", "to", "mi", "ra", "ne", "lo", "su", "vi", "de", "an", "er", "in", "on", "th", "st", "ing",
    "ed", "re", "ou", "ch", "sh", "qu", "ly", "es", "al", "or", "ar", "en", "ti", "co",
)  # fmt: skip


def corpus_text() -> str:
    """The fixed part of the tokenizer's training text (also handy as realistic filler text)."""
    return _CORPUS


def _corpus_lines(seed: int) -> Iterator[str]:
    """The fixed corpus, several times (so its merges win), then words made from syllables by ``seed``."""
    lines = _CORPUS.splitlines()
    for _ in range(8):
        yield from lines
    rng = random.Random(seed)
    for _ in range(400):
        words = ("".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 4))) for _ in range(12))
        yield " ".join(words) + rng.choice((".", ",", "?", "!", ":", ""))


def _write_atomic(path: Path, write: Callable[[Path], object]) -> None:
    """Write through a temporary sibling and rename, so a reader never sees half a file."""
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        write(tmp)
        # mkstemp creates 0600; a model directory is shared with servers and containers running as others.
        tmp.chmod(0o644)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    _write_atomic(path, lambda p: p.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n"))


def _stamp_matches(out_dir: Path, stamp_file: str, stamp: dict[str, Any]) -> bool:
    try:
        found = json.loads((out_dir / stamp_file).read_text())
    except (OSError, ValueError):
        return False
    return bool(found == stamp and all((out_dir / name).is_file() for name in stamp["files"]))


_TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json"]


def _save_tokenizer(out_dir: Path, vocab_size: int, seed: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus_lines(seed), trainer=trainer)
    bos_id = tok.token_to_id(BOS_TOKEN)
    # Like Llama 3: encode(add_special_tokens=True) prepends BOS, and the chat template writes BOS itself,
    # so chat (special tokens off) and completions (on) both start with exactly one BOS.
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B", special_tokens=[(BOS_TOKEN, bos_id)]
            ),
        ]
    )
    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        additional_special_tokens=[IM_START, IM_END],
        model_max_length=1_000_000,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out_dir))


def build_tokenizer(out_dir: Path, *, vocab_size: int = VOCAB_SIZE, seed: int = 0) -> Path:
    """Train the byte-level BPE tokenizer and save it with its chat template into ``out_dir``.

    Deterministic for a given ``vocab_size`` and ``seed``; returns at once when ``out_dir`` already
    holds that build. Needs ``tokenizers`` and ``transformers``, not torch.
    """
    out_dir = Path(out_dir)
    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(
            f"vocab_size must hold the 256 byte symbols and {len(SPECIAL_TOKENS)} special tokens "
            f"(at least {256 + len(SPECIAL_TOKENS)}); got {vocab_size}"
        )
    stamp = {"builder": BUILDER_VERSION, "vocab_size": vocab_size, "seed": seed, "files": _TOKENIZER_FILES}
    if _stamp_matches(out_dir, TOKENIZER_STAMP_FILE, stamp):
        return out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / TOKENIZER_STAMP_FILE).unlink(missing_ok=True)
    _save_into(out_dir, lambda tmp: _save_tokenizer(tmp, vocab_size, seed))
    _write_json(out_dir / TOKENIZER_STAMP_FILE, stamp)
    return out_dir


def _save_into(out_dir: Path, save: Callable[[Path], None]) -> None:
    """Save into a scratch directory, then move each file into place atomically."""
    with tempfile.TemporaryDirectory(prefix=".tinymodel-", dir=out_dir) as scratch:
        save(Path(scratch))
        for item in sorted(Path(scratch).iterdir()):
            os.replace(item, out_dir / item.name)


def llama_config(
    vocab_size: int, max_position_embeddings: int, bos_id: int, eos_id: int, pad_id: int
) -> dict[str, Any]:
    """config.json of the tiny Llama (what ``LlamaConfig(...).to_dict()`` holds, written without transformers)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "pad_token_id": pad_id,
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "hidden_size": HIDDEN_SIZE,
        "initializer_range": 0.02,
        "intermediate_size": INTERMEDIATE_SIZE,
        "max_position_embeddings": max_position_embeddings,
        "mlp_bias": False,
        "num_attention_heads": NUM_HEADS,
        "num_hidden_layers": NUM_LAYERS,
        "num_key_value_heads": NUM_KV_HEADS,
        "rms_norm_eps": 1e-6,
        "rope_scaling": None,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
        "use_cache": True,
        "vocab_size": vocab_size,
    }


def _weights(vocab_size: int, seed: int) -> dict[str, Any]:
    """Random Llama weights under the names vLLM and transformers load (lm_head tied to the embeddings)."""
    import numpy as np

    rng = np.random.default_rng(seed)

    def normal(*shape: int) -> Any:
        return (rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02)).astype(np.float32)

    kv_dim = NUM_KV_HEADS * HEAD_DIM
    tensors: dict[str, Any] = {"model.embed_tokens.weight": normal(vocab_size, HIDDEN_SIZE)}
    for layer in range(NUM_LAYERS):
        p = f"model.layers.{layer}."
        tensors[p + "self_attn.q_proj.weight"] = normal(NUM_HEADS * HEAD_DIM, HIDDEN_SIZE)
        tensors[p + "self_attn.k_proj.weight"] = normal(kv_dim, HIDDEN_SIZE)
        tensors[p + "self_attn.v_proj.weight"] = normal(kv_dim, HIDDEN_SIZE)
        tensors[p + "self_attn.o_proj.weight"] = normal(HIDDEN_SIZE, NUM_HEADS * HEAD_DIM)
        tensors[p + "mlp.gate_proj.weight"] = normal(INTERMEDIATE_SIZE, HIDDEN_SIZE)
        tensors[p + "mlp.up_proj.weight"] = normal(INTERMEDIATE_SIZE, HIDDEN_SIZE)
        tensors[p + "mlp.down_proj.weight"] = normal(HIDDEN_SIZE, INTERMEDIATE_SIZE)
        tensors[p + "input_layernorm.weight"] = np.ones(HIDDEN_SIZE, dtype=np.float32)
        tensors[p + "post_attention_layernorm.weight"] = np.ones(HIDDEN_SIZE, dtype=np.float32)
    tensors["model.norm.weight"] = np.ones(HIDDEN_SIZE, dtype=np.float32)
    return tensors


def build_tiny_model(
    out_dir: Path, *, max_position_embeddings: int = 2048, seed: int = 0, with_weights: bool = True
) -> Path:
    """Build the tiny Llama (config, generation config, tokenizer, random weights) into ``out_dir``.

    Deterministic for given arguments and idempotent: when ``out_dir`` already holds the same build (its
    stamp file records the arguments), returns at once. ``with_weights=False`` writes everything but
    ``model.safetensors`` (enough for tokenizers, planners and simulators).
    """
    out_dir = Path(out_dir)
    if max_position_embeddings < 1:
        raise ValueError(f"max_position_embeddings must be at least 1; got {max_position_embeddings}")
    files = ["config.json", "generation_config.json", *_TOKENIZER_FILES]
    if with_weights:
        files.append("model.safetensors")
    stamp: dict[str, Any] = {
        "builder": BUILDER_VERSION,
        "vocab_size": VOCAB_SIZE,
        "max_position_embeddings": max_position_embeddings,
        "seed": seed,
        "with_weights": with_weights,
        "files": files,
    }
    if _stamp_matches(out_dir, STAMP_FILE, stamp):
        return out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    # The stamp goes first so that an interrupted rebuild is never mistaken for a finished one.
    (out_dir / STAMP_FILE).unlink(missing_ok=True)
    build_tokenizer(out_dir, vocab_size=VOCAB_SIZE, seed=seed)

    ids = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    bos_id, eos_id, pad_id, im_end_id = ids[BOS_TOKEN], ids[EOS_TOKEN], ids[PAD_TOKEN], ids[IM_END]
    _write_json(out_dir / "config.json", llama_config(VOCAB_SIZE, max_position_embeddings, bos_id, eos_id, pad_id))
    _write_json(
        out_dir / "generation_config.json",
        {"bos_token_id": bos_id, "eos_token_id": [eos_id, im_end_id], "pad_token_id": pad_id},
    )
    weights_path = out_dir / "model.safetensors"
    if with_weights:
        from safetensors.numpy import save_file

        tensors = _weights(VOCAB_SIZE, seed)
        _write_atomic(weights_path, lambda p: save_file(tensors, str(p), metadata={"format": "pt"}))
    else:
        weights_path.unlink(missing_ok=True)
    _write_json(out_dir / STAMP_FILE, stamp)
    return out_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m gateway.tools.tinymodel",
        description="Build a tiny random-weight Llama with a BPE tokenizer and chat template (no downloads).",
    )
    parser.add_argument("out_dir", type=Path, help="Directory to build into (created if missing).")
    parser.add_argument("--context", type=int, default=2048, help="max_position_embeddings (default 2048).")
    parser.add_argument("--seed", type=int, default=0, help="Seed of the weights and the tokenizer corpus.")
    parser.add_argument("--no-weights", action="store_true", help="Write config and tokenizer only.")
    args = parser.parse_args(argv)
    path = build_tiny_model(
        args.out_dir, max_position_embeddings=args.context, seed=args.seed, with_weights=not args.no_weights
    )
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
