"""A checkpoint folder copied with a chat template of the test's own: the OpenAI server renders
chats with it (the tokenizer stays the copied model's)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path


def with_chat_template(model_dir: Path, dest: Path, template: str) -> Path:
    shutil.copytree(model_dir, dest)
    path = dest / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["chat_template"] = template
    path.write_text(json.dumps(config))
    return dest
