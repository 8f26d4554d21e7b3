"""`cactus serve`: the slots' scheduler without HTTP (serving), the OpenAI-compatible routes (http_api),
how an answer is shaped (http_answer), the connection guard (http_guard), tool calls (tools)."""
