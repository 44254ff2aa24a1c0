"""Anthropic's Messages API (POST /v1/messages) over headwise's local models: schemas.py (the
request), envelope.py (Anthropic's error body), messages.py (translation to the chat path,
the answer and its SSE events)."""
