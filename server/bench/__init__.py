"""`linserve bench`: a load tester for OpenAI-compatible streaming servers (linserve or any other)."""
