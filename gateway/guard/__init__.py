"""The request path of a guarded route: parse, count, plan, check the tenant, admit, exchange with the engine.

``pipeline.handle`` is the whole life of one request after the HTTP layer has read it; ``parts.Parts`` is what
every stage shares, typed on the seams of ``seams`` (what the request path needs from admission, tenants, an
engine's progress and the access log), which one process and a worker of ``--workers`` fill differently.
"""

__all__ = [
    "context",  # RequestContext, Booking, Plan: one request's state between the stages
    "counting",  # exact prompt token counts, as vLLM computes them
    "endpoints",  # one module per guarded endpoint (its request, its validation) and the table of them
    "exchange",  # the exchange with the engine: a Reply, whole or an EngineStream relayed event by event
    "models",  # Models: the engine's served models with the tokenizer
    "parts",  # Parts, Outcome
    "pipeline",  # handle: the request path
    "planning",  # the Plan of a request: what it books, what the engine is sent
    "policy",  # the limits in force, the prompt policy
    "prompts",  # the prompts of each request family
    "seams",  # the Protocols the request path is written against
    "status",  # the engines' state, as /health and /guard/status report it
]
