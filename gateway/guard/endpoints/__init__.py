"""One module per guarded endpoint, each holding its request's shape, its validation and what sets it apart on
the request path (``base.Endpoint``); ``table`` lists them all. To add an endpoint: a module here with its
parser and its ``Endpoint``, a row in ``table``, its fields in ``guard/fields.py``."""

__all__ = [
    "base",  # Endpoint, GuardedRequest, engine_body: what every endpoint shares
    "chat",  # /v1/chat/completions
    "completions",  # /v1/completions
    "pooling",  # embeddings, pooling, classify, score, rerank
    "responses",  # /v1/responses
    "table",  # ENDPOINTS, BY_NAME, BY_PATH: the one table of guarded routes
]
