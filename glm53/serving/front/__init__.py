"""The kit's OpenAI-compatible front: FastAPI routes (app.py) over one engine behind a queue
(service.py, worker.py), served by uvicorn (server.py); glm53.serving.rank runs it as a lane's rank 0."""
