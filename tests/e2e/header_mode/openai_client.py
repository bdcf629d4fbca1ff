"""Calls dprank in header mode with the OpenAI Python client, as an
application would, and prints what it got as one JSON object.

Usage: openai_client.py BASE_URL MODEL. Sends, in order: a chat completion,
a streamed chat completion with client rank headers (which dprank must strip),
a text completion and a streamed text completion. Run by tests/e2e/header.rs
and tests/e2e/vllm.rs.
"""

import json
import sys
import time

import openai

CLIENT_RANK_HEADERS = {
    "X-Data-Parallel-Rank": "3",
    "X-Override-Routed-Dp-Rank": "3",
    "X-Override-Bootstrap-Room": "7",
}


def streamed(chunks, text_of):
    """Text and chunk count of a stream, and when its first chunk came."""
    started = time.monotonic()
    first_after = None
    parts = []
    for chunk in chunks:
        if first_after is None:
            first_after = time.monotonic() - started
        parts.append(text_of(chunk))
    return {"text": "".join(parts), "chunks": len(parts), "first_after_s": first_after}


def main():
    base_url, model = sys.argv[1], sys.argv[2]
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=60)
    messages = [{"role": "user", "content": "Say something about data-parallel ranks."}]
    chat = client.chat.completions.create(model=model, messages=messages, max_tokens=8)
    chat_stream = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=24,
        stream=True,
        extra_headers=CLIENT_RANK_HEADERS,
    )
    completion = client.completions.create(model=model, prompt="Once upon", max_tokens=8)
    completion_stream = client.completions.create(model=model, prompt="Once upon", max_tokens=16, stream=True)
    result = {
        "chat": {
            "text": chat.choices[0].message.content,
            "completion_tokens": chat.usage.completion_tokens,
        },
        "completion": {
            "text": completion.choices[0].text,
            "completion_tokens": completion.usage.completion_tokens,
        },
        "chat_stream": streamed(chat_stream, lambda c: c.choices[0].delta.content or "" if c.choices else ""),
        "completion_stream": streamed(completion_stream, lambda c: c.choices[0].text if c.choices else ""),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
