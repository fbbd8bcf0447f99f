"""Where the tests' files are, wherever a test module sits in the tree."""

from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent
ROOT = TESTS.parent
FIXTURES = TESTS / "fixtures"
MODEL_CONFIGS = FIXTURES / "model_configs"
FAKE_VLLM = ROOT / "testing" / "fake_vllm.py"
