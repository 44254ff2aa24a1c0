"""Anthropic's Messages API (POST /v1/messages): schemas.py (the request), envelope.py
(Anthropic's error body), translate.py (the request as a chat request, tools included),
messages.py (local models: the engine, or the chat path for tools), via_chat.py (chat's answer
and SSE chunks as Anthropic's message and events)."""
