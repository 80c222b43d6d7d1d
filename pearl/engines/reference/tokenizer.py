"""TEMPORARY stand-in (replaced by the models branch)."""
from __future__ import annotations
from pathlib import Path
from typing import Any
from tokenizers import Tokenizer as HFTok

class Tokenizer:
    def __init__(self, tok: HFTok) -> None:
        self.tok = tok
        self.eos_token_id = tok.token_to_id("<|im_end|>")
        self.vocab_size = tok.get_vocab_size()
    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False).ids)
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return str(self.tok.decode(ids, skip_special_tokens=skip_special_tokens))
    def token_text(self, token_id: int) -> str:
        return str(self.tok.id_to_token(token_id))
    def apply_chat_template(self, messages: list[dict[str, Any]], tools: Any = None, add_generation_prompt: bool = True) -> str:
        s = "".join(f"<|im_start|>{m['role']}\n{m.get('content') or ''}<|im_end|>\n" for m in messages)
        return s + ("<|im_start|>assistant\n" if add_generation_prompt else "")

def load_tokenizer(model_dir: str | Path) -> Tokenizer:
    return Tokenizer(HFTok.from_file(str(Path(model_dir) / "tokenizer.json")))
