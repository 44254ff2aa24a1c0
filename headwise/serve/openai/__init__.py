"""One module per OpenAI endpoint family, served by a local model: chat, completions,
embeddings (+ common: sampling fields, streams, SSE). The gateway picks the target."""
