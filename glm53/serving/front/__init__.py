"""The kit's OpenAI-compatible front: FastAPI routes (app.py) over one engine behind a queue
(service.py, worker.py), served by uvicorn (server.py); front.rank runs it as a lane's rank 0."""
