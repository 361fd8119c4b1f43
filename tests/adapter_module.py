"""Import model_repository/llm/1/adapter.py (not a package module) by path, as the Triton stub does."""
import importlib.util
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
MODEL_DIR = REPO_ROOT / "model_repository" / "llm" / "1"


def load_adapter():
    """The adapter module, imported once; its siblings (triton_inputs, fault_injection) resolve as in the stub."""
    name = "inflight_triton_adapter"
    if str(MODEL_DIR) not in sys.path:
        sys.path.append(str(MODEL_DIR))
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, MODEL_DIR / "adapter.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]
