"""apibench: benchmarks of any OpenAI-compatible server through /v1/chat/completions.

`glm53-bench --url URL` (or `python -m glm53.apibench`) runs the suites decode, agent, extend and
concurrency with the official `openai` client, prints a table per suite and writes every sample
as JSON (glm53.apibench.schema.Report) with PNG plots beside it. Exit codes: 0 every suite ran; 1 a
suite failed (the JSON keeps the suites measured before it); 2 bad arguments; 3 the server could
not be used (nothing at the URL, or it answered badly before any suite ran); 130 interrupted.
"""
