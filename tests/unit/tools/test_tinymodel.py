from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from gateway.tools import tinymodel
from gateway.tools.tinymodel import build_tiny_model, build_tokenizer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), max_position_embeddings=4096)


def test_a_model_directory_holds_config_generation_config_tokenizer_and_weights(model_dir: Path) -> None:
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (model_dir / name).is_file(), name
    assert (model_dir / "model.safetensors").stat().st_size > 0


def test_the_config_is_a_llama_that_the_cpu_attention_kernels_accept(model_dir: Path) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["hidden_size"] // config["num_attention_heads"] == 64
    assert (config["num_key_value_heads"], config["num_hidden_layers"], config["vocab_size"]) == (1, 2, 512)
    assert config["max_position_embeddings"] == 4096


def test_the_weights_have_llama_names_and_shapes(model_dir: Path) -> None:
    from safetensors.numpy import load_file

    tensors = load_file(str(model_dir / "model.safetensors"))
    assert tensors["model.embed_tokens.weight"].shape == (512, 128)
    assert tensors["model.layers.1.self_attn.k_proj.weight"].shape == (64, 128)
    assert tensors["model.layers.0.mlp.down_proj.weight"].shape == (128, 256)
    assert "lm_head.weight" not in tensors  # tied to the embeddings


def test_the_weights_load_into_transformers_llama(model_dir: Path) -> None:
    torch = pytest.importorskip("torch")
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(str(model_dir))
    logits = model(torch.tensor([[1, 2, 3]])).logits
    assert logits.shape == (1, 3, 512)


def test_the_tokenizer_adds_bos_for_completions_and_the_template_writes_it_for_chat(model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    assert tok("Hello world")["input_ids"][0] == tok.bos_token_id
    ids = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=True, return_dict=False)
    assert ids.count(tok.bos_token_id) == 1
    assert tok.eos_token == "</s>" and tok.pad_token == "<pad>"


CHATS: list[tuple[str, dict[str, Any], str]] = [
    (
        "string content",
        {"conversation": [{"role": "user", "content": "Hi"}], "add_generation_prompt": True},
        "<s><|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
    ),
    (
        "text parts",
        {"conversation": [{"role": "user", "content": [{"type": "text", "text": "A"}, {"type": "text", "text": "B"}]}]},
        "<s><|im_start|>user\nAB<|im_end|>\n",
    ),
    (
        "system and tools",
        {
            "conversation": [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}],
            "tools": [{"type": "function", "function": {"name": "f"}}],
        },
        "<s><|im_start|>system\nS\n\n# Tools\n\nYou may call one or more functions to assist with the user query."
        '\n<tools>\n{"type": "function", "function": {"name": "f"}}\n</tools>\nFor each call, answer with '
        '<tool_call>{"name": ..., "arguments": ...}</tool_call>.<|im_end|>\n<|im_start|>user\nU<|im_end|>\n',
    ),
    (
        "tool call and answer",
        {
            "conversation": [
                {"role": "user", "content": "U"},
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [{"function": {"name": "f", "arguments": {"x": 1}}}],
                },
                {"role": "tool", "content": "42"},
            ]
        },
        '<s><|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}'
        "\n</tool_call><|im_end|>\n<|im_start|>tool\n<tool_response>\n42\n</tool_response><|im_end|>\n",
    ),
    (
        "continue final message",
        {
            "conversation": [{"role": "user", "content": "U"}, {"role": "assistant", "content": "The answer"}],
            "continue_final_message": True,
        },
        "<s><|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\nThe answer",
    ),
    (
        "thinking switched off",
        {"conversation": [{"role": "user", "content": "U"}], "add_generation_prompt": True, "enable_thinking": False},
        "<s><|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n",
    ),
]


@pytest.mark.parametrize(("case", "kwargs", "expected"), CHATS, ids=[c[0] for c in CHATS])
def test_the_chat_template_renders(model_dir: Path, case: str, kwargs: dict[str, Any], expected: str) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    assert tok.apply_chat_template(tokenize=False, **kwargs) == expected


def test_the_chat_template_rejects_an_unknown_role(model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    with pytest.raises(Exception, match="Unknown message role: narrator"):
        tok.apply_chat_template([{"role": "narrator", "content": "x"}], tokenize=False)


def test_a_second_build_with_the_same_arguments_returns_at_once(model_dir: Path) -> None:
    before = {p.name: p.stat().st_mtime_ns for p in model_dir.iterdir()}
    assert build_tiny_model(model_dir, max_position_embeddings=4096) == model_dir
    assert {p.name: p.stat().st_mtime_ns for p in model_dir.iterdir()} == before


def test_other_arguments_rebuild_and_no_weights_removes_them(tmp_path: Path) -> None:
    build_tiny_model(tmp_path, max_position_embeddings=1024, with_weights=True)
    build_tiny_model(tmp_path, max_position_embeddings=2048, with_weights=False)
    assert json.loads((tmp_path / "config.json").read_text())["max_position_embeddings"] == 2048
    assert not (tmp_path / "model.safetensors").exists()


def test_builds_are_identical_across_processes(tmp_path: Path, model_dir: Path) -> None:
    # Rust hash maps are seeded per process: a second interpreter proves training is deterministic.
    code = (
        "import sys; from gateway.tools.tinymodel import build_tiny_model; "
        "build_tiny_model(sys.argv[1], max_position_embeddings=4096)"
    )
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], check=True, timeout=120)
    for name in ("tokenizer.json", "model.safetensors", "config.json"):
        assert (tmp_path / name).read_bytes() == (model_dir / name).read_bytes(), name


@pytest.mark.parametrize(("seed", "same"), [(0, True), (1, False)])
def test_the_tokenizer_seed_changes_the_vocabulary(tmp_path: Path, seed: int, same: bool) -> None:
    a = build_tokenizer(tmp_path / "a", seed=0)
    b = build_tokenizer(tmp_path / "b", seed=seed)
    assert ((a / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()) is same


def test_a_vocabulary_too_small_for_the_bytes_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"at least 261\); got 100"):
        build_tokenizer(tmp_path, vocab_size=100)


def test_the_command_line_builds_without_weights_and_prints_the_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert tinymodel.main([str(tmp_path / "m"), "--context", "512", "--no-weights"]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "m")
    assert json.loads((tmp_path / "m" / "config.json").read_text())["max_position_embeddings"] == 512
    assert not (tmp_path / "m" / "model.safetensors").exists()
