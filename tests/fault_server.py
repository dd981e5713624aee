"""A small OpenAI-compatible chat-completions server that misbehaves on purpose (and a
plain text-completions endpoint that does not).

For tests and benchmarks of the regeneration client over a real socket: at `fault_rate`
a request gets one of 429 with Retry-After, 500, 503, a stall past the client's timeout,
malformed JSON, a truncated body, or an empty reply. Replies are a deterministic function
of the request, and the server counts what it answered per conversation, so a test can
assert that a resumed run sent nothing twice.

    python tests/fault_server.py --port 8000 --fault-rate 0.3
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

FAULTS = ("429", "500", "503", "stall", "malformed", "truncated", "empty")


@dataclass
class FaultPlan:
    fault_rate: float = 0.0
    faults: tuple[str, ...] = FAULTS
    seed: int = 0
    stall_s: float = 2.0
    latency_s: float = 0.0  # every reply waits this long, like a real server's decode time
    retry_after_s: float = 0.05
    api_key: str | None = None  # when set, other keys get 401
    reasoning: bool = False  # add reasoning_content to replies
    reply_words: int = 24


@dataclass
class ServerStats:
    requests: int = 0
    faults: Counter = field(default_factory=Counter)
    # conversation id -> requests received for it (any outcome)
    requested: Counter = field(default_factory=Counter)
    # (conversation id, assistant turn index) -> clean replies sent
    answered: Counter = field(default_factory=Counter)
    auth_headers: set = field(default_factory=set)
    prompts: Counter = field(default_factory=Counter)  # text completions: prompt -> requests
    lock: threading.Lock = field(default_factory=threading.Lock)


def conversation_id(messages: list[dict[str, Any]]) -> str:
    first_user = next((m["content"] for m in messages if m.get("role") == "user"), "")
    return hashlib.sha256(str(first_user).encode()).hexdigest()[:16]


def reply_text(messages: list[dict[str, Any]], words: int) -> str:
    digest = hashlib.sha256(json.dumps(messages, sort_keys=True).encode()).hexdigest()
    vocab = ["alpha", "beta", "gamma", "delta", "sure", "here", "is", "the", "answer", "step"]
    return " ".join(vocab[int(digest[i % 64], 16) % len(vocab)] for i in range(words)) + "."


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def log_message(self, *args: Any) -> None:  # quiet
        pass

    def _send(self, status: int, body: bytes, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:
        plan, stats = self.server.plan, self.server.stats
        length = int(self.headers.get("Content-Length", 0))
        body = self.rfile.read(length)
        if len(body) < length:  # the client went away mid-request: nothing to answer
            self.close_connection = True
            return
        request = json.loads(body or b"{}")
        with stats.lock:
            stats.requests += 1
            stats.auth_headers.add(self.headers.get("Authorization"))
            fault = (
                self.server.rng.choice(plan.faults)
                if self.server.rng.random() < plan.fault_rate
                else None
            )
            if fault:
                stats.faults[fault] += 1
        path = self.path.rstrip("/")
        if path.endswith("/completions") and not path.endswith("/chat/completions"):
            return self._text_completion(request)
        if not path.endswith("/chat/completions"):
            return self._send(404, b'{"error": "not found"}')
        if plan.api_key is not None and self.headers.get("Authorization") != (
            f"Bearer {plan.api_key}"
        ):
            return self._send(401, b'{"error": "invalid api key"}')
        messages = request.get("messages", [])
        with stats.lock:
            stats.requested[conversation_id(messages)] += 1
        if fault == "429":
            return self._send(429, b"{}", {"Retry-After": str(plan.retry_after_s)})
        if fault in ("500", "503"):
            return self._send(int(fault), b'{"error": "overloaded"}')
        if fault == "stall":
            time.sleep(plan.stall_s)
        elif plan.latency_s:
            time.sleep(plan.latency_s)
        max_tokens = int(request.get("max_tokens") or 10**9)
        words = reply_text(messages, plan.reply_words).split()
        finish = "length" if len(words) > max_tokens else "stop"
        text = "" if fault == "empty" else " ".join(words[:max_tokens])
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if plan.reasoning and text:
            message["reasoning_content"] = f"thinking about turn {len(messages)}"
        body = json.dumps(
            {
                "id": "chatcmpl-test",
                "object": "chat.completion",
                "model": request.get("model"),
                "choices": [{"index": 0, "message": message, "finish_reason": finish}],
                "usage": {
                    "prompt_tokens": sum(len(str(m.get("content", ""))) // 4 for m in messages),
                    "completion_tokens": min(len(words), max_tokens),
                    "cost": 0.0001,
                },
            }
        ).encode()
        try:
            if fault == "malformed":
                return self._send(200, body[: len(body) // 2] + b"}}]")
            if fault == "truncated":
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body[: len(body) // 2])
                self.wfile.flush()
                self.close_connection = True
                return None
            if fault is None:  # counted before sending, so the count is there when it lands
                turn = sum(1 for m in messages if m.get("role") == "assistant")
                with stats.lock:
                    stats.answered[(conversation_id(messages), turn)] += 1
            self._send(200, body)
        except (BrokenPipeError, ConnectionResetError):  # the client gave up (stall)
            return None
        return None

    def _text_completion(self, request: dict[str, Any]) -> None:
        """The legacy completions endpoint (prompts the target writes itself), never
        faulted: its text is its prompt's last line before the user turn, so a test sees
        which prompt each request carried."""
        prompt = str(request.get("prompt", ""))
        with self.server.stats.lock:
            self.server.stats.prompts[prompt] += 1
        lines = [line for line in prompt.splitlines() if line.strip()]
        # the system header's line (lines[1] of a ChatML prefix), after a space as a
        # continuation's first token would have
        text = f" Asked after: {lines[1] if len(lines) > 1 else prompt}"
        body = {
            "id": "cmpl-test",
            "object": "text_completion",
            "choices": [{"index": 0, "text": text, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": len(prompt) // 4, "completion_tokens": len(text) // 4},
        }
        self._send(200, json.dumps(body).encode())


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 1024  # many clients connect at once

    def __init__(self, address: tuple[str, int], plan: FaultPlan):
        super().__init__(address, _Handler)
        self.plan, self.stats = plan, ServerStats()
        self.rng = random.Random(plan.seed)


class FaultServer:
    """Run on loopback in a background thread: `with FaultServer(plan) as s: s.base_url`."""

    def __init__(self, plan: FaultPlan | None = None, port: int = 0):
        self.httpd = _Server(("127.0.0.1", port), plan or FaultPlan())
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    @property
    def stats(self) -> ServerStats:
        return self.httpd.stats

    @property
    def plan(self) -> FaultPlan:
        return self.httpd.plan

    def __enter__(self) -> FaultServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--fault-rate", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--latency", type=float, default=0.0, help="seconds per reply")
    parser.add_argument("--stall", type=float, default=2.0, help="seconds a stall lasts")
    args = parser.parse_args()
    plan = FaultPlan(args.fault_rate, seed=args.seed, latency_s=args.latency, stall_s=args.stall)
    with FaultServer(plan, args.port) as server:
        print(f"serving {server.base_url}", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            server.thread.join()


if __name__ == "__main__":
    main()
