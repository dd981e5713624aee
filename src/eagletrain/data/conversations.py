"""Reading conversations: ShareGPT (`conversations`: from/value), OpenAI messages
(`messages`: role/content, content a string or a list of text parts), or plain text.

Each record becomes a list of {"role", "content"} messages or a `Rejected` reason; a line
that is not JSON at all is an `InputError` naming file:line (or a counted skip).
"""

from __future__ import annotations

import gzip
import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagletrain.embedded import embedded_file, is_embedded
from eagletrain.errors import InputError

Message = dict[str, Any]  # role, content; regenerated assistant turns may carry token_ids

_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "assistant": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "model": "assistant",
    "system": "system",
}


@dataclass(frozen=True)
class Record:
    """One input record: where it came from, and its messages or the reason it is rejected."""

    where: str
    messages: list[Message] | None
    rejected: str | None = None

    @property
    def key(self) -> str:
        if self.messages is None or self.rejected:  # rejected records are told apart by place
            payload: Any = ["rejected", self.where]
        else:
            payload = self.messages
        canonical = json.dumps(payload, sort_keys=True, ensure_ascii=False)
        return hashlib.sha256(canonical.encode()).hexdigest()[:24]


def _content_text(content: Any) -> str | None:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
        if texts and all(isinstance(t, str) for t in texts):
            return "".join(texts)
    return None


def normalize(obj: Any, fmt: str) -> tuple[list[Message] | None, str | None]:
    """Messages from one parsed record, or (None, reason)."""
    if not isinstance(obj, dict):
        return None, "record is not a JSON object"
    if fmt in ("auto", "text") and isinstance(obj.get("text"), str):
        return [{"role": "text", "content": obj["text"]}], None
    if fmt in ("auto", "sharegpt") and "conversations" in obj:
        turns, role_key, content_key = obj["conversations"], "from", "value"
    elif fmt in ("auto", "openai") and "messages" in obj:
        turns, role_key, content_key = obj["messages"], "role", "content"
    else:
        return None, f"no {'conversations/messages' if fmt == 'auto' else fmt} field"
    if not isinstance(turns, list) or not turns:
        return None, "empty conversation"
    messages: list[Message] = []
    for turn in turns:
        if not isinstance(turn, dict):
            return None, "turn is not an object"
        role = _ROLES.get(str(turn.get(role_key, "")).lower())
        if role is None:
            return None, f"unknown role {str(turn.get(role_key))[:20]!r}"
        text = _content_text(turn.get(content_key))
        if text is None:
            return None, "non-string content"
        messages.append({"role": role, "content": text})
    # ShareGPT splits long chats into chunks that start mid-way with an assistant turn;
    # with no question before it, such a turn teaches nothing: drop it (as SpecForge does).
    first = next((i for i, m in enumerate(messages) if m["role"] != "system"), len(messages))
    while first < len(messages) and messages[first]["role"] == "assistant":
        del messages[first]
    if not any(m["role"] == "assistant" for m in messages):
        return None, "no assistant turn"
    return messages, None


def _array_objects(path: Path, text: str) -> Iterator[tuple[str, Any, str | None]]:
    """Elements of a JSON array, decoded one at a time so a bad element is located exactly."""
    decoder = json.JSONDecoder()
    pos, index = text.index("[") + 1, 0
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text):
            yield (
                f"{path.name}:{text.count(chr(10), 0, pos) + 1}",
                None,
                "file ends inside the array",
            )
            return
        if text[pos] == "]":
            return
        try:
            obj, end = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as err:
            line = text.count("\n", 0, pos) + 1
            yield f"{path.name}:{line}", None, f"invalid JSON in element {index} ({err.msg})"
            return
        yield f"{path.name}[{index}]", obj, None
        pos, index = end, index + 1


def _parsed_objects(path: Path) -> Iterator[tuple[str, Any, str | None]]:
    """(where, object, parse error) for a JSON array file or a JSONL file."""
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt", encoding="utf-8-sig") as f:
            text = f.read()
    except UnicodeDecodeError as err:
        raise InputError(f"{path}: not UTF-8 text ({err.reason} at byte {err.start})") from None
    if text.lstrip().startswith("["):
        yield from _array_objects(path, text)
        return
    # JSONL lines end at "\n" only: str.splitlines() would also split inside strings that
    # hold U+2028, U+0085 and the like, which json.dumps(ensure_ascii=False) writes raw
    for lineno, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        try:
            yield f"{path.name}:{lineno}", json.loads(line), None
        except json.JSONDecodeError as err:
            yield f"{path.name}:{lineno}", None, f"invalid JSON ({err.msg})"


def source_path(source: str) -> Path:
    if is_embedded(source):
        return embedded_file(source)
    path = Path(source).expanduser()
    if not path.is_file():
        raise InputError(f"{path}: conversations file not found")
    return path


def read_records(source: str, fmt: str, on_malformed: str = "error") -> Iterator[Record]:
    """Records of a source. A line that is not JSON is an error naming file:line, or with
    on_malformed="skip" a rejected record (counted, never silently dropped). The packaged
    ShareGPT file is known to end mid-record: that tail is always a counted skip."""
    path = source_path(source)
    for where, obj, parse_error in _parsed_objects(path):
        if parse_error is not None:
            if on_malformed == "error" and not is_embedded(source):
                raise InputError(f"{path.parent}/{where}: {parse_error}")
            yield Record(where, None, parse_error)
            continue
        messages, reason = normalize(obj, fmt)
        yield Record(where, messages, reason)
