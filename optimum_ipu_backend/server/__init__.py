"""``optimum-ipu serve``: one ORTModel on ``provider="ipu"`` behind an HTTP server (docs/deployment.md).

The server is a consumer of the public ORTModel API and sits above everything else, like the CLI:

``models.py``   the served model: task, tokenizer, limits, and the calls (embed, classify, generate)
``schemas.py``  the request bodies of every endpoint (pydantic), with their limits
``metrics.py``  the Prometheus registry: request metrics, and the sessions' own counters at scrape time
``app.py``      the ASGI app (FastAPI): the endpoints, 4xx/5xx JSON errors, loading and draining
``ray_app.py``  the same app as a Ray Serve deployment (``optimum-ipu serve --ray``)
"""
